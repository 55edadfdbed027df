"""POST /logprobs/compare: does the server still give a completion the logprobs the caller holds?

    {"prompt_token_ids": [...], "token_ids": [...],      # the completion those logprobs belong to
     "logprobs": [...],                                   # one per token_ids (what /generate returned)
     "weight_version": 3,                                 # the version that produced them (or the
                                                          # per-token list /generate returned)
     "temperature": 1.0,                                  # the logprobs are of logits / temperature
     "allow_version_mismatch": false}
 -> {"weight_version": <live>, "num_tokens", "temperature", "batch_invariant",
     "logprobs": [recomputed], "diffs": [recomputed - given], "max_abs_diff", "mean_abs_diff",
     "max_abs_diff_index"}

The server recomputes the sequence teacher-forced under its live weights (rollout/api/scoring.py:
the prompt-logprobs path, the batch-invariant forward under --batch-invariant, where a match is
exact: every diff 0.0). A rollout's "processed" logprobs are of logits / temperature when the
request used no top-k / top-p / min-p; with them, add each token's sampling_mask kept_logmass
first (it undoes the renormalisation over the kept set), or sample with logprobs_mode "raw" and
compare at temperature 1. Temperature 0 (greedy) logprobs are the raw logits': 0 reads as 1.

A `weight_version` other than the live one is a 409 naming it, before any work (logprobs of other
weights differ by design), unless `allow_version_mismatch`; weights that change while the
recompute runs are a 409 too (retry). Lengths that disagree, empty lists, ids outside the
vocabulary and a sequence the context cannot hold are 400s naming the field.
"""
import math

from fastapi import APIRouter, Request
from pydantic import Field

from engine.errors import InvalidRequestError
from rollout.api.control import call
from rollout.api.dispatch import json_object, one_of, parse
from rollout.api.errors import APIError, engine_error
from rollout.api.protocol import _Strict
from rollout.api.scoring import recompute, recompute_params
from rollout.api.state import get_state

router = APIRouter(tags=["generate"])


class LogprobsCompareBody(_Strict):
    prompt_token_ids: list[int] = Field(min_length=1)
    token_ids: list[int] = Field(min_length=1)
    logprobs: list[float] = Field(min_length=1)
    weight_version: int | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    allow_version_mismatch: bool = False


@router.post("/logprobs/compare", openapi_extra=one_of(LogprobsCompareBody))
async def compare_logprobs(request: Request):
    body: LogprobsCompareBody = parse(LogprobsCompareBody, await json_object(request))
    state = get_state(request)
    _check(state, body)
    live = await call(state.engine.get_weight_version())
    given = _given_versions(body)
    if given and given != {live} and not body.allow_version_mismatch:
        raise APIError(409, f"the logprobs are of weight version(s) {sorted(given)}, the server holds version "
                            f"{live}: logprobs of other weights differ by design (pass allow_version_mismatch "
                            f"to compare anyway)", "weight_version")
    try:
        params = recompute_params(0, body.temperature, temp_scaled=True)
    except InvalidRequestError as e:
        raise engine_error(e, "temperature") from e
    (out,) = await recompute(request, [body.prompt_token_ids + body.token_ids], "token_ids", params, "compare")
    if not out.outputs[0].weight_versions or out.prompt_logprobs is None:
        raise APIError(409, "the recompute was aborted before it finished (generation paused with mode 'abort', "
                            "or an /abort_requests): retry")
    after = out.outputs[0].weight_versions[0]
    if after != live:  # a push landed while it ran: some positions may be of either weights
        raise APIError(409, f"the weights changed from version {live} to {after} during the recompute: retry",
                       "weight_version")
    recomputed = out.prompt_logprobs[len(body.prompt_token_ids):]
    diffs = [r - g for r, g in zip(recomputed, body.logprobs)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    return {"weight_version": live, "num_tokens": len(diffs), "temperature": body.temperature,
            "batch_invariant": bool(getattr(state.engine.config, "batch_invariant", False)),
            "logprobs": recomputed, "diffs": diffs, "max_abs_diff": abs(diffs[worst]),
            "mean_abs_diff": math.fsum(abs(d) for d in diffs) / len(diffs), "max_abs_diff_index": worst}


def _check(state, body: LogprobsCompareBody) -> None:
    """400s naming the field, before the engine sees the request."""
    if len(body.logprobs) != len(body.token_ids):
        raise APIError(400, f"logprobs has {len(body.logprobs)} entries, token_ids {len(body.token_ids)}: one "
                            "logprob per completion token", "logprobs")
    if isinstance(body.weight_version, list) and len(body.weight_version) != len(body.token_ids):
        raise APIError(400, f"weight_version has {len(body.weight_version)} entries, token_ids "
                            f"{len(body.token_ids)}: give one version, or one per completion token", "weight_version")
    bad = next((i for i, lp in enumerate(body.logprobs) if not math.isfinite(lp)), None)
    if bad is not None:  # (JSON's NaN / Infinity, which Python's parser takes)
        raise APIError(400, f"logprobs[{bad}] is {body.logprobs[bad]}: a sampled token's logprob is finite",
                       "logprobs")
    vocab = state.engine.processor.vocab_size
    for name in ("prompt_token_ids", "token_ids"):
        ids = getattr(body, name)
        i = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if i is not None:
            raise APIError(400, f"{name}[{i}] = {ids[i]} is out of the vocabulary [0, {vocab})", name)
    total, limit = len(body.prompt_token_ids) + len(body.token_ids), state.engine.max_model_len
    if total >= limit:
        raise APIError(400, f"prompt_token_ids + token_ids hold {total} tokens; the context holds {limit} "
                            f"(max_model_len), and the recompute needs one more", "token_ids")


def _given_versions(body: LogprobsCompareBody) -> set[int]:
    v = body.weight_version
    return set() if v is None else set(v) if isinstance(v, list) else {v}
