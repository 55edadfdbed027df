"""The model runner's own per-request state (sampling params, prompt-logprob progress), which
it keeps between steps from what the SchedulerOutput tells it: it must survive preemption
(recompute from scratch) without repeating or losing anything. Tiny random-weight model, with a
KV cache so small that two requests cannot both finish without one being preempted."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.default_model import default_model_path

PROMPTS = [list(range(100, 140)), list(range(200, 240))]  # 40 tokens each: 3 blocks of 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers * (k, v) * kv heads * head_dim * fp32 * block_size


def run(tiny_folder, num_blocks: int, params: SamplingParams):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_folder, dtype="float32", multiprocess=False, kv_cache_memory=num_blocks * BLOCK_BYTES,
              tokenizer=str(default_model_path()), enable_prefix_caching=False)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return outs, llm.get_stats()["num_preemptions"]
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=1),
    SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True, prompt_logprobs=0),
], ids=["greedy", "seeded"])
def test_preemption_keeps_prompt_logprobs_and_seeded_sampling(tiny_folder, params):
    roomy, roomy_preemptions = run(tiny_folder, 64, params)
    tight, tight_preemptions = run(tiny_folder, 8, params)  # 8 blocks < the 10 both requests end with
    assert roomy_preemptions == 0 and tight_preemptions > 0
    for a, b in zip(roomy, tight):
        assert len(b.prompt_logprobs) == len(PROMPTS[0])  # [None] + one per later prompt token, not repeated
        assert b.prompt_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(b.prompt_logprobs[1:]), torch.tensor(a.prompt_logprobs[1:]),
                                   rtol=0, atol=1e-5)
        if params.prompt_logprobs:
            assert [sorted(t) for t in b.prompt_top_logprobs[1:]] == [sorted(t) for t in a.prompt_top_logprobs[1:]]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids  # greedy, or the same seeded generator
