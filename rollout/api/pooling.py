"""Encode routes, with OpenAI's and vLLM's names and shapes:

    POST /v1/embeddings {"input", "encoding_format", "normalize", "pooling"}  -> OpenAI's embedding list
         (a causal LM's final hidden state at the last prompt token, or the mean; unit length by default)
    POST /pooling {"input", "pooling"}   -> {"data": [{"index", "object": "pooling", "data": [...]}], ...}
         (the raw pooled vector: for a sequence classifier / reward model, its label logits = scores)
    POST /classify {"input"}             -> {"data": [{"index", "label", "probs", "num_classes"}], ...}
         (a sequence classifier's label probabilities: softmax, or sigmoid for one label)

`input` is a string, token ids, or a list of either (at most `--max-encode-inputs` of them, 2048 by
default: more is a 400 naming `input`). A causal LM serves embeddings and pooling, a
sequence classifier classify and pooling (`GET /server_info` lists them as `supported_tasks`);
the other route is a 400 saying which the model serves.
"""
import base64
import math
import struct
import time

from fastapi import APIRouter, Request

from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.api.cancel import gather_all, until_disconnect
from rollout.api.errors import APIError
from rollout.api.generate import final_output, tokenize_prompts
from rollout.api.openai import check_model
from rollout.api.protocol import ClassificationRequest, EmbeddingRequest, PoolingRequest, normalize_prompts
from rollout.api.state import get_state

router = APIRouter(tags=["encode"])


async def _encode(request: Request, body, task: str, prefix: str) -> tuple[str, list]:
    """(request id, the RequestOutput of every input) for a route serving `task`."""
    state = get_state(request)
    check_model(state, body.model)
    tasks = state.engine.get_supported_tasks()
    if task not in tasks:
        raise APIError(400, f"this model does not serve {task!r} (it serves {', '.join(tasks)})", "model")
    params = SamplingParams(pooling=body.pooling, max_tokens=1, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = normalize_prompts(body.input, "input")
    ids = await tokenize_prompts(state, prompts, "input", len(prompts) > 1, params)
    base = state.new_request_id(body.request_id or request.headers.get("x-request-id"), prefix)
    rids = [f"{base}-{i}" for i in range(len(ids))] if len(ids) > 1 else [base]
    outs = await until_disconnect(request, gather_all(
        final_output(state.generate(p, params, rid, "input")) for p, rid in zip(ids, rids)))
    return base, outs


def _usage(outs) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported (the model's hidden size is the embedding size)",
                       "dimensions")
    base, outs = await _encode(request, body, "embed", "embd")
    data = []
    for i, out in enumerate(outs):
        vec = out.pooled
        if body.normalize:
            norm = math.sqrt(sum(x * x for x in vec)) or 1.0
            vec = [x / norm for x in vec]
        if body.encoding_format == "base64":  # little-endian float32, as OpenAI's
            vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    return {"id": base, "object": "list", "created": int(time.time()), "model": get_state(request).model_name,
            "data": data, "usage": _usage(outs)}


@router.post("/pooling")
async def pooling(body: PoolingRequest, request: Request):
    state = get_state(request)
    task = "classify" if "classify" in state.engine.get_supported_tasks() else "embed"
    base, outs = await _encode(request, body, task, "pool")
    return {"id": base, "object": "list", "created": int(time.time()), "model": state.model_name,
            "data": [{"index": i, "object": "pooling", "data": o.pooled} for i, o in enumerate(outs)],
            "usage": _usage(outs)}


@router.post("/classify")
async def classify(body: ClassificationRequest, request: Request):
    base, outs = await _encode(request, body, "classify", "classify")
    labels = get_state(request).engine.config.model_config.id2label
    data = []
    for i, out in enumerate(outs):
        logits = out.pooled
        if len(logits) == 1:
            probs = [1 / (1 + math.exp(-logits[0]))]
        else:
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            probs = [e / sum(exps) for e in exps]
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels.get(best, f"LABEL_{best}"), "probs": probs,
                     "num_classes": len(probs)})
    return {"id": base, "object": "list", "created": int(time.time()), "model": get_state(request).model_name,
            "data": data, "usage": _usage(outs)}
