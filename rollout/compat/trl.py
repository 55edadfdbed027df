"""`trl vllm-serve`'s own routes, for trainers on TRL 1.10 and older (trl@1.10.0:
trl/scripts/vllm_serve.py, called by trl/generation/vllm_client.py; the paths end in a slash).
TRL 1.11 and later talk to vLLM's own routes instead, which rollout/api serves (/v1/completions
with return_token_ids, /v1/chat/completions, /server_info, /get_world_size, ...).

    GET  /health/, /get_world_size/                   -> 307 to our /health, {"world_size"}
    POST /generate/ {prompts: texts | token id lists, n, temperature, top_p, top_k, min_p,
         max_tokens, logprobs (0), repetition_penalty, generation_kwargs}
                                                      -> {prompt_ids, completion_ids (n per prompt,
                                                          prompt-major), logprobs, logprob_token_ids}
    POST /chat/ {messages: [conversation, ...], same sampling, chat_template_kwargs, tools}
                                                      -> the same four keys
    POST /get_sequence_logprobs/ {sequences, prompt_lengths, top_logprobs (100), temperature,
         response_format: "json" | "binary"}          -> json: {logprobs, logprob_token_ids} from each
         prompt_length on, best first; binary (TRL 1.10's default): base64 float32 / int32 arrays
         {logprobs_b64, token_ids_b64, actual_logprobs_b64, actual_token_ids_b64, shape, completion_lengths}
    POST /reset_prefix_cache/                         -> {"message": "...status: True"}
    POST /init_communicator/, /update_named_param/, /close_communicator/  -> 501

Each route is a translation onto the one engine API (ServerState.generate, the chat renderer,
the control routes). Logprobs are sorted best first, as TRL sorts vLLM's by rank: the sampled
token's logprob and the top-k (k + 1 entries when the sampled token is not among them); prompt
logprobs are the model's raw log-softmax, as vLLM's GPU model runner computes them, so
`temperature` does not change them. `top_logprobs` goes up to the engine's 20 (vLLM's default
--max-logprobs, which `trl vllm-serve` 1.10 kept: its client's default of 100 needed a smaller
value there too).

Not here: images (`images`, `image_pil` parts: 400; /v1/chat/completions takes image_url parts),
`structured_outputs_regex` (400: no guided decoding), and weight sync. TRL 1.10 pushes
weights by joining vLLM's StatelessProcessGroup with a PyNcclCommunicator (NCCL on CUDA, the
trainer as the last rank, one broadcast per tensor): that wire protocol is vLLM's, so those
routes answer 501 naming ours (/init_weight_transfer_engine ... /finish_weight_update, or
rollout.RolloutClient.push_weights). Errors take the shape `trl vllm-serve` answers with (FastAPI's
{"detail": message}), with a 4xx for bad input.
"""
import base64
import math
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import InvalidRequestError
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.api import control
from rollout.api.chat_render import render_chat
from rollout.api.dispatch import json_object, one_of
from rollout.api.errors import APIError, engine_error, validation_message, validation_param
from rollout.api.logprobs_json import ranked_prompt_logprobs
from rollout.api.protocol import PENALTIES, ChatMessage, check_wire_values, make_sampling_params, refuse_penalties
from rollout.api.scoring import recompute, recompute_params, run_to_end
from rollout.api.state import get_state

router = APIRouter(tags=["trl"])
ENGINE_FIELDS = frozenset(SamplingParams.__struct_fields__) - {"output_kind", "pooling"}
WEIGHT_ROUTES = ("TRL 1.10's weight sync joins vLLM's StatelessProcessGroup with a PyNcclCommunicator, a wire "
                 "protocol this server does not speak; push weights through /init_weight_transfer_engine, "
                 "/start_weight_update, /update_weights and /finish_weight_update (rollout.RolloutClient."
                 "init_weight_transfer / push_weights), or /update_weights_from_disk")


class _Body(BaseModel):
    """Strict bodies (an unknown field is a 400): TRL's client sends only these fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _values_fit(cls, data: Any) -> Any:
        check_wire_values(data)
        return data


class TRLSampling(_Body):
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = 0
    structured_outputs_regex: str | None = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)


class TRLGenerateRequest(TRLSampling):
    prompts: list[str] | list[list[int]] = Field(min_length=1)
    images: list[list[str] | None] | None = None


class TRLChatRequest(TRLSampling):
    messages: list[list[ChatMessage]] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict] | None = None


class TRLSequenceLogprobsRequest(_Body):
    sequences: list[list[int]] = Field(min_length=1)
    prompt_lengths: list[int]
    top_logprobs: int = 100
    temperature: float = 1.0
    response_format: Literal["json", "binary"] = "json"


async def _read(request: Request, model: type[BaseModel]):
    """The body validated as `model` (an APIError naming the field otherwise)."""
    try:
        return model.model_validate(await json_object(request))
    except ValidationError as e:
        first = e.errors()[0]
        param = validation_param(("body", *first["loc"]))
        raise APIError(400, validation_message(first, param), param) from None


def _detail(e: APIError) -> JSONResponse:
    return JSONResponse({"detail": e.message if e.param is None else f"{e.param}: {e.message}"},
                        status_code=e.status)


def _sampling_params(body: TRLSampling) -> SamplingParams:
    """TRL's sampling fields (generation_kwargs over them, as vLLM's SamplingParams(**kw) reads
    them) as the engine's SamplingParams; what the engine lacks is a 400 naming it."""
    if body.structured_outputs_regex is not None:
        raise APIError(400, "structured outputs (guided decoding) are not supported by this engine",
                       "structured_outputs_regex")
    kw = {"n": body.n, "repetition_penalty": body.repetition_penalty, "temperature": body.temperature,
          "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p, "max_tokens": body.max_tokens,
          "logprobs": body.logprobs, **body.generation_kwargs}
    refuse_penalties(kw)
    for name in PENALTIES:
        kw.pop(name, None)
    unknown = sorted(set(kw) - ENGINE_FIELDS)
    if unknown:
        raise APIError(400, f"not a sampling parameter of this engine: {unknown} (it takes "
                            f"{sorted(ENGINE_FIELDS)})", f"generation_kwargs.{unknown[0]}")
    try:
        return make_sampling_params(dict(kw, output_kind=RequestOutputKind.FINAL_ONLY))
    except InvalidRequestError as e:
        raise engine_error(e) from e


async def _generate(request: Request, prompts: list, field: str, params: SamplingParams) -> list[RequestOutput]:
    return await run_to_end(request, prompts, field, params, "trl")


def _best_first(c: CompletionOutput, i: int) -> list[tuple[int, float]]:
    top = {c.token_ids[i]: c.logprobs[i], **(c.top_logprobs[i] if c.top_logprobs is not None else {})}
    return sorted(top.items(), key=lambda kv: -kv[1])


def _completions_json(outs: list[RequestOutput]) -> dict:
    """{prompt_ids, completion_ids, logprobs, logprob_token_ids}, prompt-major (TRL's
    extract_logprobs shape: [sequence][position][best first], NaN as null)."""
    seqs = [c for out in outs for c in sorted(out.outputs, key=lambda c: c.index)]
    answer = {"prompt_ids": [out.prompt_token_ids for out in outs], "completion_ids": [c.token_ids for c in seqs],
              "logprobs": None, "logprob_token_ids": None}
    if seqs and all(c.logprobs is not None for c in seqs):
        ranked = [[_best_first(c, i) for i in range(len(c.token_ids))] for c in seqs]
        answer["logprobs"] = [[[None if math.isnan(lp) else lp for _, lp in pos] for pos in seq] for seq in ranked]
        answer["logprob_token_ids"] = [[[t for t, _ in pos] for pos in seq] for seq in ranked]
    return answer


@router.get("/health/")
async def health_slash(request: Request):
    """307 to our /health (which TRL's requests.get follows; it reads the status only)."""
    return RedirectResponse(str(request.url_for("health")), status_code=307)


@router.get("/get_world_size/")
async def get_world_size(request: Request):
    """tensor x data parallel ranks, as `trl vllm-serve` counts them."""
    return await control.get_world_size(request, include_dp=True)


@router.post("/generate/", openapi_extra=one_of(TRLGenerateRequest))
async def generate(request: Request):
    try:
        body = await _read(request, TRLGenerateRequest)
        if body.images and any(images for images in body.images):
            raise APIError(400, "images are not supported on /generate/: send image_url parts to "
                                "/v1/chat/completions", "images")
        return _completions_json(await _generate(request, list(body.prompts), "prompts", _sampling_params(body)))
    except APIError as e:
        return _detail(e)


@router.post("/chat/", openapi_extra=one_of(TRLChatRequest))
async def chat(request: Request):
    """One rendered conversation per entry of `messages`, as vLLM's LLM.chat renders a batch."""
    try:
        body = await _read(request, TRLChatRequest)
        params = _sampling_params(body)
        if any(isinstance(m.content, list) and any(p.type != "text" for p in m.content)
               for convo in body.messages for m in convo):
            raise APIError(400, "image parts are not supported on /chat/: send image_url parts to "
                                "/v1/chat/completions", "messages")
        state = get_state(request)
        prompts = [await render_chat(state, convo, chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
                   for convo in body.messages]
        return _completions_json(await _generate(request, prompts, "messages", params))
    except APIError as e:
        return _detail(e)


@router.post("/get_sequence_logprobs/", openapi_extra=one_of(TRLSequenceLogprobsRequest))
async def get_sequence_logprobs(request: Request):
    """The logprobs of existing sequences (a teacher scoring a student's completions): the
    teacher-forced recompute of rollout/api/scoring.py, with prompt_logprobs = top_logprobs (raw
    log-softmax: `temperature` is checked, not applied, as `trl vllm-serve` does)."""
    try:
        body = await _read(request, TRLSequenceLogprobsRequest)
        if len(body.sequences) != len(body.prompt_lengths):
            raise APIError(400, f"sequences ({len(body.sequences)}) and prompt_lengths ({len(body.prompt_lengths)}) "
                                "must have the same length", "prompt_lengths")
        for i, (seq, length) in enumerate(zip(body.sequences, body.prompt_lengths)):
            if not 0 <= length <= len(seq):
                raise APIError(400, f"prompt_lengths[{i}] is {length}, outside [0, {len(seq)}] (its sequence's "
                                    "length)", f"prompt_lengths[{i}]")
        try:
            params = recompute_params(body.top_logprobs, body.temperature)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "top_logprobs" if e.param == "prompt_logprobs" else e.param) from e
        outs = await recompute(request, body.sequences, "sequences", params, "trl")
        if body.response_format == "binary":
            return _binary_logprobs(outs, body.prompt_lengths, body.top_logprobs)
        return _json_logprobs(outs, body.prompt_lengths)
    except APIError as e:
        return _detail(e)


def _ranked(out: RequestOutput, position: int) -> list[tuple[int, float, int]]:
    """[(token_id, logprob, rank)] of one prompt position by rank (none at position 0: no prefix)."""
    return [] if position == 0 else sorted(ranked_prompt_logprobs(out, position), key=lambda e: e[2])


def _json_logprobs(outs: list[RequestOutput], prompt_lengths: list[int]) -> dict:
    """TRL 1.10's "json" answer: per sequence, per position from its prompt length, every entry
    (the top-k and the actual token) by rank."""
    ranked = [[_ranked(out, pos) for pos in range(length, len(out.prompt_token_ids))]
              for out, length in zip(outs, prompt_lengths)]
    return {"logprobs": [[[None if math.isnan(lp) else lp for _, lp, _ in pos] for pos in seq] for seq in ranked],
            "logprob_token_ids": [[[t for t, _, _ in pos] for pos in seq] for seq in ranked]}


def _binary_logprobs(outs: list[RequestOutput], prompt_lengths: list[int], top_k: int) -> dict:
    """TRL 1.10's "binary" answer: the top_k by rank and the actual token's logprob, as base64
    float32 / int32 arrays of shape [batch, longest completion, top_k] (and [..., 1]), padded
    with -inf and token id 0."""
    lengths = [len(out.prompt_token_ids) - length for out, length in zip(outs, prompt_lengths)]
    shape = (len(outs), max(lengths, default=0), top_k)
    logprobs = np.full(shape, -np.inf, dtype=np.float32)
    token_ids = np.zeros(shape, dtype=np.int32)
    actual_logprobs = np.full(shape[:2] + (1,), -np.inf, dtype=np.float32)
    actual_ids = np.zeros(shape[:2] + (1,), dtype=np.int32)
    for i, (out, start) in enumerate(zip(outs, prompt_lengths)):
        for pos in range(max(start, 1), len(out.prompt_token_ids)):
            t = pos - start
            actual_ids[i, t, 0] = out.prompt_token_ids[pos]
            if not math.isnan(out.prompt_logprobs[pos]):
                actual_logprobs[i, t, 0] = out.prompt_logprobs[pos]
            for k, (token_id, lp, _) in enumerate(_ranked(out, pos)[:top_k]):
                token_ids[i, t, k] = token_id
                if not math.isnan(lp):
                    logprobs[i, t, k] = lp

    def b64(a: np.ndarray) -> str:
        return base64.b64encode(a.tobytes()).decode("ascii")

    return {"logprobs_b64": b64(logprobs), "token_ids_b64": b64(token_ids), "actual_logprobs_b64": b64(actual_logprobs),
            "actual_token_ids_b64": b64(actual_ids), "shape": list(shape), "completion_lengths": lengths}


@router.post("/reset_prefix_cache/", tags=["admin"])
async def reset_prefix_cache(request: Request):
    success = bool(await control.call(get_state(request).engine.reset_prefix_cache()))
    return {"message": f"Request received, resetting prefix cache status: {success}"}


@router.post("/init_communicator/", tags=["admin"])
@router.post("/update_named_param/", tags=["admin"])
@router.post("/close_communicator/", tags=["admin"])
async def weight_routes(request: Request):
    """501: see the module docstring (weight sync)."""
    return JSONResponse({"detail": WEIGHT_ROUTES}, status_code=501)
