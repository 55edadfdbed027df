"""The engine's outputs as /generate's JSON (a leaf shared by /generate and session turns):
`request_output_json` for one result, `usage_json` for a request's token counts."""
import base64

import numpy as np

from engine.frontend.outputs import CompletionOutput, RequestOutput


def completion_json(c: CompletionOutput) -> dict:
    d = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs,
         "weight_versions": c.weight_versions, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.lora_versions:  # a LoRA adapter's request: its version per token
        d["lora_versions"] = c.lora_versions
    if c.top_logprobs is not None:  # [[token_id, logprob], ...] per step, best first
        d["top_logprobs"] = [sorted(([t, lp] for t, lp in step.items()), key=lambda x: -x[1])
                             for step in c.top_logprobs]
    if c.sampling_masks is not None:
        d["sampling_mask"] = sampling_mask_json(c.sampling_masks)
    if c.routed_experts is not None:
        d["routed_experts"] = routed_experts_json(c.routed_experts)
    return d


def routed_experts_json(rows: np.ndarray) -> dict:
    """(num_tokens, num_layers, top_k) int16 expert ids (-1 in dense layers), compactly: base64 of
    the little-endian bytes, row-major (rollout.client decodes it to the array)."""
    return {"shape": list(rows.shape), "dtype": "int16",
            "data": base64.b64encode(rows.astype("<i2", copy=False).tobytes()).decode("ascii")}


def sampling_mask_json(masks: list) -> dict:
    """Each token's kept set (engine.protocol.SamplingMask), column by column: "ids"[i] is null
    where the request asked no ids, or the set was larger than MAX_SAMPLING_MASK_IDS."""
    return {"num_kept": [m.num_kept for m in masks], "min_logprob": [m.min_logprob for m in masks],
            "kept_logmass": [m.kept_logmass for m in masks], "ids": [m.ids for m in masks]}


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
