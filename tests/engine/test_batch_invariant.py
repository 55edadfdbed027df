"""Batch-invariant mode (EngineConfig(batch_invariant=True)): a request's tokens, sample logprobs and
prompt logprobs are the same bits alone and inside batches of 1..64 (other prompts of random lengths
and sampling parameters, a copy of the prompt hitting the prefix cache, chunked prefill by a small
token budget), and equal to the trainer-side recompute `engine.model.batch_invariant.InvariantScorer`,
also after a weight push. The default mode differs between batch sizes on the real model (checked
in the slow test, so that this test is known to be able to fail)."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model.batch_invariant import InvariantScorer

GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=0, prompt_logprobs=0)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=0, prompt_logprobs=0)


def run_in_batch(llm, target, size, rng, mine=(GREEDY, SAMPLED)):
    """Requests for `target` with the params `mine`, in a batch of `size` at random places: the
    (token ids, logprobs, prompt logprobs) of each."""
    prompts, params = [target] * len(mine), list(mine)
    for _ in range(size - len(mine)):
        prompts.append([rng.randrange(10, 40000) for _ in range(rng.randint(3, 90))])
        params.append(SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0, 0.7, 1.0]),
                                     top_p=rng.choice([1.0, 0.9]), logprobs=rng.choice([None, 0, 2])))
    order = list(range(len(prompts)))
    rng.shuffle(order)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], [params[i] for i in order],
                        use_tqdm=False)
    got = {i: o for i, o in zip(order, outs) if i < len(mine)}
    return [(got[i].outputs[0].token_ids, got[i].outputs[0].logprobs, got[i].prompt_logprobs)
            for i in range(len(mine))]


def check_invariant(llm, scorer, target, sizes, seed=0):
    """Each request alone, then both in batches of `sizes`: the same bits; equal to the scorer."""
    rng = random.Random(seed)
    alone = [run_in_batch(llm, target, 1, rng, (p,))[0] for p in (GREEDY, SAMPLED)]
    for size in sizes:
        assert run_in_batch(llm, target, size, rng) == alone, f"batch of {size}"
    # the trainer's recompute: sample logprobs (under each request's temperature) and prompt logprobs
    for (ids, lps, prompt_lps), temperature in zip(alone, (1.0, 0.8)):
        got = scorer.token_logprobs([target + ids], temperature=temperature)[0].tolist()
        assert got[len(target) - 1:] == lps
        if temperature == 1.0:
            assert got[:len(target) - 1] == prompt_lps[1:]
    return alone


def test_batch_invariant_on_a_tiny_model(tiny_folder, default_model_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, multiprocess=False, batch_invariant=True,
              max_num_batched_tokens=48)
    scorer = InvariantScorer(tiny_folder)
    target = list(range(300, 340))
    try:
        before = check_invariant(llm, scorer, target, sizes=(3, 16, 64))
        # a push (weights perturbed as a trainer's step would): still invariant, still equal the scorer
        g = torch.Generator().manual_seed(1)
        new = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in scorer.model.hf_views()}
        llm.update_weights_from_tensors(list(new.items()))
        scorer.load_state_dict(new)
        after = check_invariant(llm, scorer, target, sizes=(5, 32), seed=1)
        assert after[0][1] != before[0][1]  # the push changed the logprobs
    finally:
        llm.shutdown()


def test_batch_invariant_configuration(tiny_folder):
    assert EngineConfig(tiny_folder, batch_invariant=True).dtype == "float32"
    with pytest.raises(ValueError, match="float32 on CPU"):
        EngineConfig(tiny_folder, batch_invariant=True, dtype="bfloat16")
    with pytest.raises(Exception, match="token"):
        InvariantScorer(tiny_folder).token_logprobs([[]])


@pytest.mark.slow
def test_batch_invariant_on_the_default_model(default_model_path):
    """The real model in float32: invariant across batches of 1..64, equal to the scorer; and the
    default mode is not (the property this mode exists for)."""
    target = list(range(100, 140))
    scorer = InvariantScorer(default_model_path)
    llm = LLM(default_model_path, multiprocess=False, batch_invariant=True, dtype="float32",
              max_num_batched_tokens=256)
    try:
        check_invariant(llm, scorer, target, sizes=(3, 8, 17, 64))
    finally:
        llm.shutdown()
    llm = LLM(default_model_path, multiprocess=False, dtype="float32", max_num_batched_tokens=256)
    try:
        rng = random.Random(0)
        alone = run_in_batch(llm, target, 1, rng, (GREEDY,))
        assert any(run_in_batch(llm, target, size, rng, (GREEDY,)) != alone for size in (8, 17, 64))
    finally:
        llm.shutdown()
