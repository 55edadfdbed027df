"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE with
"stream": true, `data: [DONE]` at the end; usage in a last chunk with
stream_options.include_usage); vLLM's /v1/chat/completions/render, /tokenize, /detokenize,
/tokenizer_info and /version.

Beyond OpenAI, as vLLM answers them (what TRL's VLLMClient reads): top_k, min_p, min_tokens,
stop_token_ids, ignore_eos, ...; "return_token_ids": true adds each choice's `token_ids` and
`weight_versions` (ours), and the prompt's ids: per choice on /v1/completions
(`prompt_token_ids`), once at the top level on /v1/chat/completions; "return_tokens_as_token_ids"
labels logprob tokens "token_id:<id>"; /v1/completions' "prompt_logprobs": k gives each choice
vLLM's `prompt_logprobs` (rollout/api/logprobs_json.py). Several prompts with n samples each:
prompt-major, choice index = prompt * n + sample. An X-Request-Id header (or "request_id") names
the engine request, for /abort_requests. Ours, as extra fields: max_weight_staleness,
min_weight_version, stale_action (engine/core/staleness.py: a choice a weight push leaves too stale
ends with finish_reason "stale"; "restart" is refused with stream); return_routed_experts (SGLang's
request field; a mixture-of-experts model served with --enable-return-routed-experts): each choice's
"routed_experts" {"shape": [N, L, k], "dtype": "int16", "data": base64}, the experts of its prompt and
output tokens but the last (vLLM answers nested lists, the prompt's apart as prompt_routed_experts);
streamed, each chunk's new rows.
"""
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.errors import InvalidRequestError
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.api.cancel import gather_all, until_disconnect
from rollout.api.chat_prefix import prefixed_prompt
from rollout.api.chat_render import off_loop, render_chat
from rollout.api.errors import APIError, engine_error
from rollout.api.generate import final_output, tokenize_prompts
from rollout.api.logprobs_json import TokenText, chat_logprobs, completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from rollout.api.output_json import routed_experts_json, usage_json
from rollout.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                  normalize_prompts)
from rollout.api.state import ServerState, get_state, request_route
from rollout.api.streaming import DONE, error_event, merge, prime, sse

router = APIRouter(tags=["openai"])


@router.get("/v1/models")
async def list_models(request: Request):
    state = get_state(request)
    created = int(time.time())
    base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "rollout",
            "root": state.model_path, "max_model_len": state.engine.max_model_len}
    adapters = [{"id": name, "object": "model", "created": created, "owned_by": "rollout", "root": lora.lora_path,
                 "parent": state.model_name, "max_model_len": state.engine.max_model_len}
                for name, lora in state.loras.items()]
    return {"object": "list", "data": [base, *adapters]}


def _tokens(state: ServerState) -> TokenText:
    tok = getattr(state, "_tokens", None)
    if tok is None:
        tok = state._tokens = TokenText(state.engine.tokenizer)
    return tok


def _echoed(out: RequestOutput, c: CompletionOutput, tokens: TokenText, label, prompt_text: str, body) -> dict:
    """A completion choice with the prompt echoed: its text and, with logprobs, the prompt's
    per-token logprobs before the generated ones (max_tokens 0: the prompt's alone)."""
    score_only = body.scores_prompt_only
    ch = {"text": prompt_text if score_only else prompt_text + c.text, "logprobs": None}
    if score_only:
        ch.update(finish_reason="length", stop_reason=None)
    if body.logprobs is None or out.prompt_logprobs is None:
        return ch
    lp = echo_logprobs(out, tokens, label)
    if not score_only and c.logprobs is not None:
        gen = completion_logprobs(c, tokens, len(prompt_text), label)
        for k in lp:
            lp[k] = lp[k] + gen[k]
    ch["logprobs"] = lp
    return ch


def check_model(state: ServerState, model: str | None) -> None:
    """The base model only (routes that take no LoRA adapter); 404 for another name."""
    if state.resolve_model(model) is not None:
        raise APIError(400, f"{model!r} is a LoRA adapter: this route serves the base model only", "model")


def _request_id(state: ServerState, request: Request, body, prefix: str) -> str:
    return state.new_request_id(body.request_id or request.headers.get("x-request-id"), prefix)


def _params(body, stream: bool):
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return body.to_sampling_params(kind)
    except InvalidRequestError as e:
        raise engine_error(e) from e


def _versions(c: CompletionOutput) -> dict:
    d = {"token_ids": c.token_ids, "weight_versions": c.weight_versions}
    if c.lora_versions:
        d["lora_versions"] = c.lora_versions
    return d


def _choices(outs: list[RequestOutput], n: int, state: ServerState, chat: bool, body, prefix_text: list[str]):
    """Prompt-major: the n choices of prompt 0 (index 0..n-1), then prompt 1's, ..."""
    tokens = _tokens(state)
    label = tokens.labeler(body.return_tokens_as_token_ids)
    choices = []
    for p, out in enumerate(outs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            text = prefix_text[p] + c.text
            ch = {"index": p * n + c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if chat:
                ch["message"] = {"role": "assistant", "content": text}
                ch["logprobs"] = chat_logprobs(c, label)
            elif getattr(body, "echo", False):
                ch.update(_echoed(out, c, tokens, label, prefix_text[p], body))
            else:
                ch["text"] = text
                ch["logprobs"] = completion_logprobs(c, tokens, len(prefix_text[p]), label)
            if body.return_token_ids:  # (chat: the prompt's ids once, at the top level, as vLLM)
                ch.update(_versions(c) if chat else dict(_versions(c), prompt_token_ids=out.prompt_token_ids))
            if not chat and body.prompt_logprobs is not None:
                ch["prompt_logprobs"] = vllm_prompt_logprobs(out, tokens)
            if c.routed_experts is not None:
                ch["routed_experts"] = routed_experts_json(c.routed_experts)
            choices.append(ch)
    return choices


async def _serve(request: Request, body, prompts: list, field: str, chat: bool, extra: dict | None = None):
    """`extra`: fields for the answer's top level (the stream's first chunk)."""
    state = get_state(request)
    state.check_can_generate()
    lora = state.resolve_model(body.model)
    params = _params(body, body.stream)
    ids = await tokenize_prompts(state, prompts, field, len(prompts) > 1, params)
    base = _request_id(state, request, body, "chatcmpl" if chat else "cmpl")
    rids = [f"{base}-{i}" for i in range(len(ids))] if len(ids) > 1 else [base]
    route = request_route(request)
    gens = [state.generate(p, params, rid, field, lora, body.cache_salt, route) for p, rid in zip(ids, rids)]
    echo = [p if isinstance(p, str) else state.engine.tokenizer.decode(p) for p in prompts] \
        if getattr(body, "echo", False) else [""] * len(prompts)
    if getattr(body, "echo", False) and body.stream and (body.logprobs is not None or body.max_tokens == 0):
        raise APIError(400, "echo with logprobs or max_tokens 0 needs stream: false", "echo")
    if not chat and body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs needs stream: false", "prompt_logprobs")
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    headers = {"X-Request-Id": base}
    if not body.stream:
        outs = await until_disconnect(request, gather_all(final_output(g) for g in gens))
        answer = {"id": base, "object": obj, "created": created, "model": state.model_name,
                  "choices": _choices(outs, params.n, state, chat, body, echo), "usage": usage_json(outs)}
        if chat and body.return_token_ids:
            answer["prompt_token_ids"] = outs[0].prompt_token_ids
        answer.update(extra or {})
        return JSONResponse(answer, headers=headers)
    firsts = await prime(gens, request)
    return StreamingResponse(_events(state, body, gens, firsts, params.n, base, created, chat, echo, extra),
                             media_type="text/event-stream", headers=headers)


async def _events(state, body, gens, firsts, n: int, base: str, created: int, chat: bool, echo: list[str],
                  extra: dict | None = None):
    tokens = _tokens(state)
    label = tokens.labeler(body.return_tokens_as_token_ids)
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": base, "object": obj, "created": created, "model": state.model_name}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    prompt_lens: dict[int, int] = {}
    num_tokens = 0
    sent_first = set()
    async for p, out in merge(gens, firsts):
        if isinstance(out, BaseException):
            yield sse(error_event(out))
            continue
        chunk = dict(head)
        if chat and body.return_token_ids and not sent_first:  # vLLM's: the prompt's ids in the first chunk
            chunk["prompt_token_ids"] = out.prompt_token_ids
        if extra and not sent_first:
            chunk.update(extra)
        prompt_lens[p] = len(out.prompt_token_ids)
        choices = []
        for c in out.outputs:
            idx = p * n + c.index
            num_tokens += len(c.token_ids)
            ch = {"index": idx, "finish_reason": c.finish_reason}
            prefix = echo[p] if idx not in sent_first else ""
            if chat:
                delta = {"content": c.text}
                if idx not in sent_first:
                    delta["role"] = "assistant"
                ch["delta"] = delta
                ch["logprobs"] = chat_logprobs(c, label)
            else:
                ch["text"] = prefix + c.text
                ch["logprobs"] = completion_logprobs(c, tokens, 0, label)
            if c.finish_reason is not None:
                ch["stop_reason"] = c.stop_reason
            if body.return_token_ids:
                ch.update(_versions(c))
                if not chat and idx not in sent_first:
                    ch["prompt_token_ids"] = out.prompt_token_ids
            if c.routed_experts is not None:  # the rows new since the previous chunk
                ch["routed_experts"] = routed_experts_json(c.routed_experts)
            sent_first.add(idx)
            choices.append(ch)
        yield sse(dict(chunk, choices=choices))
    if include_usage:
        prompt = sum(prompt_lens.values())
        yield sse(dict(head, choices=[], usage={"prompt_tokens": prompt, "completion_tokens": num_tokens,
                                                 "total_tokens": prompt + num_tokens}))
    yield DONE


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _serve(request, body, normalize_prompts(body.prompt), "prompt", chat=False)


async def _render(state: ServerState, body: ChatCompletionRequest) -> tuple[str | dict | list[int], dict]:
    """The prompt (rendered text, or ids with prefix_token_ids) and the answer's extra fields
    (with prefix_token_ids: the prompt's ids and the drift; rollout/api/chat_prefix.py)."""
    if body.prefix_token_ids is None:
        return await render_chat(state, body.messages, body.add_generation_prompt, body.continue_final_message,
                                 body.chat_template_kwargs, body.tools), {}
    body.check_unsupported()
    prefixed = await prefixed_prompt(state, body.messages, body.prefix_token_ids, body.add_generation_prompt,
                                     body.chat_template_kwargs, body.tools)
    return prefixed.token_ids, dict(prompt_token_ids=prefixed.token_ids, **prefixed.answer_fields())


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    prompt, extra = await _render(get_state(request), body)
    return await _serve(request, body, [prompt], "messages", chat=True, extra=extra)


@router.post("/v1/chat/completions/render")
async def render_chat_completion(body: ChatCompletionRequest, request: Request):
    """vLLM's render step (served there with --enable-scale-out): what /v1/chat/completions would
    run, as vLLM's GenerateRequest, without running it: the rendered prompt's `token_ids` and the
    request's `sampling_params` (max_tokens made concrete as vLLM does). `features` stays null:
    a conversation with images is refused (501), as their vLLM MultiModalFeatures (processed
    pixel tensors and hashes) are not a format this engine produces."""
    state = get_state(request)
    state.resolve_model(body.model)
    params = _params(body, stream=False)
    prompt, _ = await _render(state, body)
    if isinstance(prompt, dict):
        raise APIError(501, "conversations with images cannot be rendered here: vLLM's MultiModalFeatures "
                            "(the `features` of its answer) are not produced by this engine; send the "
                            "conversation to /v1/chat/completions instead", "messages")
    [ids] = await tokenize_prompts(state, [prompt], "messages", False, params)
    sampling = {k: v for k, v in msgspec.structs.asdict(params).items() if k not in ("pooling", "logprobs_mode")}
    if sampling["max_tokens"] is None:
        sampling["max_tokens"] = state.engine.max_model_len - len(ids)
    sampling["output_kind"] = int(params.output_kind)
    return {"request_id": _request_id(state, request, body, "chatcmpl"), "token_ids": ids, "token_offsets": None,
            "features": None, "content_parts": None, "sampling_params": sampling, "model": state.model_name,
            "stream": body.stream, "stream_options": body.stream_options and body.stream_options.model_dump(),
            "cache_salt": body.cache_salt, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}


# ---- vLLM's tokenizer and info routes ---------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """{"count", "max_model_len", "tokens"[, "token_strs"]}: the ids the engine would run (a
    text prompt as is, messages through the chat template)."""
    state = get_state(request)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    text = body.prompt if body.messages is None else await render_chat(
        state, body.messages, body.add_generation_prompt, chat_template_kwargs=body.chat_template_kwargs,
        tools=body.tools)
    tok = state.engine.tokenizer
    if isinstance(text, dict):  # messages with images: their placeholders expanded, as the engine runs them
        ids = (await tokenize_prompts(state, [text], "messages", False, SamplingParams()))[0].ids
    else:
        ids = await off_loop(tok.encode, text, size=len(text), add_special_tokens=body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = get_state(request)
    check_model(state, body.model)
    vocab = state.engine.processor.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {body.tokens[bad]} is out of the vocabulary [0, {vocab})", f"tokens[{bad}]")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """The tokenizer's configuration (as vLLM serves it: what a client needs to tokenize alike)."""
    tok = get_state(request).engine.tokenizer
    return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok), "model_max_length": tok.model_max_length,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
            "unk_token": tok.unk_token, "add_bos_token": getattr(tok, "add_bos_token", None),
            "chat_template": tok.chat_template, "added_tokens_decoder": {
                str(i): t.content for i, t in tok.added_tokens_decoder.items()}}


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("rollout")}
    except PackageNotFoundError:
        return {"version": "unknown"}
