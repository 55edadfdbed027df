"""POST /generate: the RL route. Token ids in (or text), token ids + per-token logprobs + the
weight version of every token out.

    {"prompt_token_ids": [[1, 2, 3], [4, 5]],            # or "prompt": "text" / ["a", "b"]
     "sampling_params": {"temperature": 1.0, "max_tokens": 64, "logprobs": 0, "n": 2},
     "stream": false, "request_id": "optional-id"}
 -> {"results": [{"request_id", "prompt_token_ids", "num_cached_tokens", "finished",
                  "outputs": [{"index", "text", "token_ids", "logprobs", "top_logprobs",
                               "weight_versions", "finish_reason", "stop_reason",
                               "lora_versions" (with a LoRA adapter as "model")}, ... n]}, ...],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

A batch request's prompts get ids "<request_id>-<i>". With "stream": true every line (NDJSON,
or SSE with "stream_format": "sse", ending in `data: [DONE]`) is one result's delta plus
"prompt_index"; the last line of each result has "finished": true. `logprobs[i]` is the
sampled token's logprob under the distribution it was drawn from (see SamplingParams).
sampling_params' return_sampling_mask (true / "threshold" / "ids") adds each output's
"sampling_mask": {"num_kept", "min_logprob", "kept_logmass", "ids"}, one entry per token: the set
top-k / top-p / min-p left it to be drawn from (engine.protocol.SamplingMask; output_json.py).
sampling_params' return_routed_experts (a mixture-of-experts model served with
--enable-return-routed-experts) adds each output's "routed_experts": {"shape": [N, L, k], "dtype":
"int16", "data": base64 of the little-endian bytes}: the experts every layer routed each of the
N = prompt + output - 1 tokens to (-1 in dense layers); streamed, each line's rows are the new ones.
sampling_params' max_weight_staleness / min_weight_version / stale_action are the server's
staleness rules (engine/core/staleness.py; finish_reason "stale"; "restart" is refused with stream).
With "session_params": {"id": ...} the prompt is the next turn of an open session
(rollout/api/sessions.py). One request may sample at most `--max-request-tokens` tokens, prompts x
n x max_tokens (tokenize_prompts checks it for every generation route).
"""

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.errors import InvalidRequestError
from engine.frontend.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind
from rollout.api.cancel import gather_all, until_disconnect
from rollout.api.chat_prefix import prefixed_prompt
from rollout.api.chat_render import check_image_urls, off_loop, render_chat
from rollout.api.dispatch import alternate, json_object, one_of, parse
from rollout.api.errors import APIError, engine_error
from rollout.api.output_json import request_output_json, usage_json
from rollout.api.protocol import GenerateRequest, make_sampling_params
from rollout.api.sessions import generate_turn
from rollout.api.state import get_state, request_route
from rollout.api.streaming import DONE, error_event, merge, ndjson, prime, sse

router = APIRouter(tags=["generate"])


def _tokenize_all(state, prompts: list, field: str, batch: bool, params) -> list[list[int]]:
    ids = []
    for i, p in enumerate(prompts):
        try:
            processed = state.engine.processor.process(p, params)
            ids.append(processed.ids if processed.mm_features is None else processed)  # (images travel along)
        except InvalidRequestError as e:
            raise APIError(400, f"{field}[{i}]: {e}" if batch else str(e), field) from e
    return ids


async def tokenize_prompts(state, prompts: list, field: str, batch: bool, params,
                           params_field: str = "") -> list[list[int]]:
    """Token ids of every prompt, checked now (a bad prompt is a 400 naming it; `params_field`
    prefixes the name of a sampling parameter at fault), and the request's size against the
    server's caps (ServerConfig.max_encode_inputs, max_request_tokens)."""
    limit = state.engine.max_model_len
    if params.max_tokens is not None and params.max_tokens >= limit:  # can never fit (the engine would clamp)
        raise APIError(400, f"max_tokens is {params.max_tokens}, but the context holds {limit} tokens "
                            f"(max_model_len) including the prompt; a request whose prompt + max_tokens exceeds "
                            f"it stops at the context's end with finish_reason 'length'", params_field + "max_tokens")
    if params.return_routed_experts:
        field_name = params_field + "return_routed_experts"
        try:
            state.engine.processor.check_routed_experts(params)
        except InvalidRequestError as e:
            raise APIError(400, str(e).replace("return_routed_experts", field_name, 1), field_name) from e
    encode = params.pooling is not None
    if encode and len(prompts) > state.config.max_encode_inputs:
        raise APIError(400, f"{field} has {len(prompts)} inputs; this server takes at most "
                            f"{state.config.max_encode_inputs} per call (--max-encode-inputs): split them over "
                            f"several calls", field)
    if not encode and params.max_tokens is not None:  # what it asks is known before tokenizing
        _check_request_tokens(state, len(prompts) * params.n * params.max_tokens, len(prompts), params, params_field)
    size = sum(len(p) for p in prompts if isinstance(p, str))
    ids = await off_loop(_tokenize_all, state, prompts, field, batch, params, size=size)
    if not encode and params.max_tokens is None:  # up to the room the context leaves each prompt
        room = sum(limit - len(p if isinstance(p, list) else p.ids) for p in ids)
        _check_request_tokens(state, params.n * room, len(prompts), params, params_field)
    return ids


def _check_request_tokens(state, total: int, num_prompts: int, params, params_field: str) -> None:
    """A 400 for a generation request that may sample more tokens than the server takes from one
    request: its answer is held whole in this process until it is sent."""
    cap = state.config.max_request_tokens
    if total <= cap:
        return
    max_tokens = params.max_tokens if params.max_tokens is not None else "unset (up to the context's end)"
    raise APIError(400, f"this request may sample {total} tokens ({num_prompts} prompt(s) x n={params.n} x "
                        f"max_tokens {max_tokens}); the server takes at most {cap} per request "
                        f"(--max-request-tokens): lower n or max_tokens, or split the batch over several requests",
                   params_field + "max_tokens")


async def final_output(gen) -> RequestOutput:
    """The last output of an engine stream (FINAL_ONLY streams have just one)."""
    out = None
    async for out in gen:  # noqa: B007
        pass
    if out is None:
        raise APIError(500, "the engine returned no output")
    return out


@router.post("/generate", openapi_extra=one_of(GenerateRequest))
async def generate(request: Request):
    data = await json_object(request)
    answer = await alternate("/generate", request, data)  # SGLang's body (rollout/compat/sglang.py)
    if answer is not None:
        return answer
    body: GenerateRequest = parse(GenerateRequest, data)
    state = get_state(request)
    state.check_can_generate()
    prompts, field, batch, extra = await _prompts(state, body)
    # a session turn reads deltas until its chunk ends (the request itself never finishes)
    kind = RequestOutputKind.DELTA if body.stream or body.session_params else RequestOutputKind.FINAL_ONLY
    params = _sampling_params(body, kind)
    ids = await tokenize_prompts(state, prompts, field, batch, params, "sampling_params.")
    lora = state.resolve_model(body.model)
    if body.session_params is not None:
        return await _session_turn(request, body, field, batch, ids, params, lora)
    base = state.new_request_id(body.request_id, "gen")
    rids = [f"{base}-{i}" for i in range(len(ids))] if batch else [base]
    route = request_route(request)
    gens = [state.generate(p, params, rid, field, lora, body.cache_salt, route) for p, rid in zip(ids, rids)]
    if not body.stream:
        outs = await until_disconnect(request, gather_all(final_output(g) for g in gens))
        results = [request_output_json(o) for o in outs]
        results[0].update(extra)
        return {"results": results, "usage": usage_json(outs)}
    return await _streamed(request, body, gens, base, extra)


async def _prompts(state, body: GenerateRequest) -> tuple[list, str, bool, dict]:
    """The request's prompts (texts, token ids, a rendered conversation, or one text with its
    images), the field they came in, whether it is a batch, and fields for the first result
    (a conversation with prefix_token_ids: its drift, rollout/api/chat_prefix.py)."""
    prompts, field, batch = body.prompts()
    extra = {}
    if body.prefix_token_ids is not None:

        if body.session_params is not None:
            raise APIError(400, "a session turn takes no prefix_token_ids (the session holds the turns so far)",
                           "prefix_token_ids")
        prefixed = await prefixed_prompt(state, body.messages, body.prefix_token_ids, body.add_generation_prompt,
                                         body.chat_template_kwargs, body.tools)
        prompts, extra = [prefixed.token_ids], prefixed.answer_fields()
    elif body.messages is not None:
        prompts = [await render_chat(state, body.messages, body.add_generation_prompt,
                                     chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)]
    if body.multi_modal_data is not None:
        if field != "prompt" or batch:
            raise APIError(400, "multi_modal_data goes with one text prompt (with an <image> marker per image)",
                           "multi_modal_data")
        check_image_urls(body.multi_modal_data.get("image", []), "multi_modal_data")
        prompts = [{"prompt": prompts[0], "multi_modal_data": body.multi_modal_data}]
    return prompts, field, batch, extra


def _sampling_params(body: GenerateRequest, kind: RequestOutputKind):
    try:
        return make_sampling_params(dict(body.sampling_params.model_dump(), output_kind=kind))
    except InvalidRequestError as e:
        err = engine_error(e)
        raise APIError(400, str(e), f"sampling_params.{err.param}" if err.param else "sampling_params") from e


async def _session_turn(request: Request, body: GenerateRequest, field: str, batch: bool, ids: list, params, lora):
    """The request as the next turn of an open session (rollout/api/sessions.py)."""
    if lora is not None:
        raise APIError(400, "sessions run on the base model (no LoRA adapter)", "model")
    if batch:
        raise APIError(400, "a session turn takes one prompt, not a batch", field)
    if not isinstance(ids[0], list):
        raise APIError(400, "session turns take no images", field)
    if body.request_id is not None:
        raise APIError(400, "a session turn has no request_id of its own (the session is the request)",
                       "request_id")
    return await generate_turn(request, body.session_params.id, field, ids[0], params, body.stream,
                               sse if body.stream_format == "sse" else ndjson,
                               DONE if body.stream_format == "sse" else None)


async def _streamed(request: Request, body: GenerateRequest, gens: list, base: str,
                    extra: dict | None = None) -> StreamingResponse:
    """The streams' deltas as NDJSON or SSE lines, each with its "prompt_index", primed first (a
    refused prompt is still an error response); `extra` goes into the first line."""
    firsts = await prime(gens, request)
    use_sse = body.stream_format == "sse"
    frame = sse if use_sse else ndjson

    async def events():
        first = dict(extra or {})
        async for i, item in merge(gens, firsts):
            if isinstance(item, BaseException):
                yield frame(dict(error_event(item), prompt_index=i))
                continue
            yield frame(dict(request_output_json(item), prompt_index=i, **first))
            first = {}
        if use_sse:
            yield DONE

    return StreamingResponse(events(), media_type="text/event-stream" if use_sse else "application/x-ndjson",
                             headers={"X-Request-Id": base})
