"""POST /generate: the RL route. Token ids in (or text), token ids + per-token logprobs + the
weight version of every token out.

    {"prompt_token_ids": [[1, 2, 3], [4, 5]],            # or "prompt": "text" / ["a", "b"]
     "sampling_params": {"temperature": 1.0, "max_tokens": 64, "logprobs": 0, "n": 2},
     "stream": false, "request_id": "optional-id"}
 -> {"results": [{"request_id", "prompt_token_ids", "num_cached_tokens", "finished",
                  "outputs": [{"index", "text", "token_ids", "logprobs", "top_logprobs",
                               "weight_versions", "finish_reason", "stop_reason"}, ... n]}, ...],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

A batch request's prompts get ids "<request_id>-<i>". With "stream": true every line (NDJSON,
or SSE with "stream_format": "sse", ending in `data: [DONE]`) is one result's delta plus
"prompt_index"; the last line of each result has "finished": true. `logprobs[i]` is the
sampled token's logprob under the distribution it was drawn from (see SamplingParams).
"""
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from rollout.api.errors import APIError, engine_error
from rollout.api.protocol import GenerateRequest, make_sampling_params
from rollout.api.state import gather_all, get_state, until_disconnect
from rollout.api.streaming import DONE, error_event, merge, ndjson, prime, sse

router = APIRouter(tags=["generate"])


def completion_json(c: CompletionOutput) -> dict:
    d = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs,
         "weight_versions": c.weight_versions, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.top_logprobs is not None:  # [[token_id, logprob], ...] per step, best first
        d["top_logprobs"] = [sorted(([t, lp] for t, lp in step.items()), key=lambda x: -x[1])
                             for step in c.top_logprobs]
    return d


def request_output_json(out: RequestOutput) -> dict:
    d = {"request_id": out.request_id, "prompt_token_ids": out.prompt_token_ids,
         "num_cached_tokens": out.num_cached_tokens, "finished": out.finished,
         "outputs": [completion_json(c) for c in out.outputs]}
    if out.prompt_logprobs is not None:
        d["prompt_logprobs"] = out.prompt_logprobs
    return d


def usage_json(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def tokenize_prompts(state, prompts: list, field: str, batch: bool, params) -> list[list[int]]:
    """Token ids of every prompt, checked now (a bad prompt is a 400 naming it)."""
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(state.engine.processor.process(p, params)[1])
        except InvalidRequestError as e:
            raise APIError(400, f"{field}[{i}]: {e}" if batch else str(e), field) from e
    return ids


async def final_output(gen) -> RequestOutput:
    """The last output of an engine stream (FINAL_ONLY streams have just one)."""
    out = None
    async for out in gen:  # noqa: B007
        pass
    if out is None:
        raise APIError(500, "the engine returned no output")
    return out


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    state = get_state(request)
    state.check_can_generate()
    prompts, field, batch = body.prompts()
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    try:
        params = make_sampling_params(dict(body.sampling_params.model_dump(), output_kind=kind))
    except InvalidRequestError as e:
        err = engine_error(e)
        raise APIError(400, str(e), f"sampling_params.{err.param}" if err.param else "sampling_params") from e
    ids = tokenize_prompts(state, prompts, field, batch, params)
    base = state.new_request_id(body.request_id, "gen")
    rids = [f"{base}-{i}" for i in range(len(ids))] if batch else [base]
    gens = [state.generate(p, params, rid, field) for p, rid in zip(ids, rids)]
    if not body.stream:
        outs = await until_disconnect(request, gather_all(final_output(g) for g in gens))
        return {"results": [request_output_json(o) for o in outs], "usage": usage_json(outs)}
    firsts = await prime(gens, request)
    use_sse = body.stream_format == "sse"
    frame = sse if use_sse else ndjson

    async def events():
        async for i, item in merge(gens, firsts):
            if isinstance(item, BaseException):
                yield frame(dict(error_event(item), prompt_index=i))
                continue
            yield frame(dict(request_output_json(item), prompt_index=i))
        if use_sse:
            yield DONE

    return StreamingResponse(events(), media_type="text/event-stream" if use_sse else "application/x-ndjson",
                             headers={"X-Request-Id": base})
