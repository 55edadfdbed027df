"""Teacher-forced recompute: the logprobs of existing token sequences under the live weights.

Each sequence runs as a prompt with prompt_logprobs and one sampled token, which is left out:
the engine's prompt-logprobs path (engine/worker/model_runner.py compute_prompt_logprobs), and
so the batch-invariant forward when the server runs --batch-invariant, where a recomputed
logprob equals the one sampled under the same weights bit for bit (engine/model/batch_invariant.py).
Shared by /logprobs/compare (rollout/api/logprobs_compare.py) and `trl vllm-serve`'s
/get_sequence_logprobs/ (rollout/compat/trl.py), which differ only in what they make of it.
"""
from fastapi import Request

from engine.frontend.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.api.cancel import gather_all, until_disconnect
from rollout.api.generate import final_output, tokenize_prompts
from rollout.api.protocol import make_sampling_params
from rollout.api.state import get_state


def recompute_params(top_logprobs: int = 0, temperature: float = 1.0, temp_scaled: bool = False) -> SamplingParams:
    """SamplingParams of a recompute: prompt logprobs with the top `top_logprobs`, raw log-softmax
    (vLLM's and TRL's), or of logits / temperature with `temp_scaled` (what "processed" sampled
    logprobs are without top-k / top-p / min-p). InvalidRequestError names a bad field."""
    return make_sampling_params({"max_tokens": 1, "temperature": temperature, "prompt_logprobs": top_logprobs,
                                 "temp_scaled_prompt_logprobs": temp_scaled,
                                 "output_kind": RequestOutputKind.FINAL_ONLY})


async def run_to_end(request: Request, prompts: list, field: str, params: SamplingParams,
                     id_prefix: str) -> list[RequestOutput]:
    """Every prompt (checked first: a 400 naming `field`) run to its final output, at once."""
    state = get_state(request)
    state.check_can_generate()
    ids = await tokenize_prompts(state, prompts, field, True, params)
    base = state.new_request_id(None, id_prefix)
    gens = [state.generate(p, params, f"{base}-{i}", field) for i, p in enumerate(ids)]
    return await until_disconnect(request, gather_all(final_output(g) for g in gens))


async def recompute(request: Request, sequences: list[list[int]], field: str, params: SamplingParams,
                    id_prefix: str = "score") -> list[RequestOutput]:
    """Each sequence's RequestOutput: prompt_logprobs[t] = log p(sequence[t] | sequence[:t]) for
    t >= 1 (params from recompute_params)."""
    assert params.max_tokens == 1 and params.prompt_logprobs is not None, "recompute_params makes them"
    return await run_to_end(request, [list(s) for s in sequences], field, params, id_prefix)
