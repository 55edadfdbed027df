"""Kept sets (kernels.sampling.kept_sets, engine's return_sampling_mask) on random logits: each
row's export is the set its filters kept, computed here independently from the logits, with ties
at a cut resolved toward lower token ids; greedy rows keep their token; asking for a set does not
change what is drawn."""
import pytest
import torch

from kernels.sampling import sample
from tests.kernels.test_sampling import metadata, random_logits, seeded

V = 300
CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "top_k+top_p": dict(top_k=40, top_p=0.7),
    "all three": dict(top_k=50, top_p=0.9, min_p=0.02),
    "none": dict(),
}


def reference_kept(x: torch.Tensor, top_k=0, top_p=1.0, min_p=0.0) -> list[int]:
    """The kept ids of one row of logits / temperature, highest first, ties by lower id (sorted by
    hand: value descending, then id ascending), top-k keeping every token tied at the k-th value
    unless top-p cuts through them."""
    order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    keep = [i for i in order if x[i] > float("-inf")]
    if top_k and top_p >= 1:
        kth = float(x[order[top_k - 1]])
        keep = [i for i in keep if float(x[i]) >= kth]
    elif top_k:
        keep = keep[:top_k]
    if top_p < 1:
        p = torch.tensor([float(x[i]) for i in keep]).softmax(0)
        before = p.cumsum(0) - p
        keep = [i for i, b in zip(keep, before.tolist()) if b < top_p] or keep[:1]
    if min_p > 0:
        p = torch.tensor([float(x[i]) for i in keep]).softmax(0)
        keep = [i for i, q in zip(keep, p.tolist()) if q >= min_p * float(p.max())]
    return keep


def _mask_md(rows, ids=True, **case):
    md = metadata(rows, generators=seeded(range(rows)), logprobs=0, **case)
    md.mask_rows, md.mask_max_ids = {r: ids for r in range(rows)}, V
    return md


@pytest.mark.parametrize("case", list(CASES))
def test_kept_set_is_the_filters_set(case):
    rows, T = 6, 0.8
    logits = random_logits(rows, V, seed=3)
    # bf16-rounded logits: ties at the cuts, whose resolution is part of the contract
    logits = logits.bfloat16().float()
    out = sample(logits.clone(), _mask_md(rows, temperature=T, **CASES[case]))
    assert set(out.kept_sets) == set(range(rows))
    for r in range(rows):
        x = logits[r] / T
        want = reference_kept(x, **CASES[case])
        ks = out.kept_sets[r]
        assert ks.ids == want, f"row {r}: {ks.ids[:10]} vs {want[:10]}"
        assert ks.num_kept == len(want)
        assert int(out.token_ids[r]) in ks.ids
        lps = x.log_softmax(0)
        assert ks.min_logprob == pytest.approx(float(lps[want].min()), abs=1e-5)
        assert ks.kept_logmass == pytest.approx(float(lps[want].logsumexp(0)), abs=1e-5)
        # the processed logprob (renormalised over the set) + kept_logmass = the untruncated one
        assert float(out.logprobs[r]) + ks.kept_logmass == pytest.approx(float(lps[out.token_ids[r]]), abs=1e-5)


def test_a_top_p_cut_through_equal_logits_keeps_the_lower_ids():
    """Five tokens of equal logit share 0.5 of the mass; top_p 0.6 cuts between them: the lowest
    ids of the group are kept, whatever order the vocabulary has them in."""
    x = torch.full((1, 20), -30.0)
    group = [17, 3, 11, 6, 14]
    x[0, 0] = 0.0  # mass 0.5
    x[0, group] = 0.0 - torch.log(torch.tensor(5.0))  # five tokens of mass 0.1 each
    out = sample(x.clone(), _mask_md(1, top_p=0.75))
    # 0.5 (token 0), then 0.1 each: the mass before a token is < 0.75 for the first three of them
    assert out.kept_sets[0].ids == [0, 3, 6, 11]
    assert out.kept_sets[0].num_kept == 4


def test_top_k_keeps_every_tie_at_the_kth_value():
    x = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]])
    out = sample(x.clone(), _mask_md(1, top_k=3))
    assert out.kept_sets[0].ids == [0, 1, 2, 3, 4] and out.kept_sets[0].num_kept == 5


def test_greedy_rows_keep_their_token_in_a_mixed_batch():
    logits = random_logits(4, V, seed=5)
    md = _mask_md(4, temperature=[1.0, 0.7, 1.0, 1.0], greedy=[True, False, True, False], top_p=0.9)
    out = sample(logits.clone(), md)
    for r in (0, 2):
        ks = out.kept_sets[r]
        t = int(logits[r].argmax())
        assert int(out.token_ids[r]) == t and ks.ids == [t] and ks.num_kept == 1
        assert ks.min_logprob == ks.kept_logmass == pytest.approx(float(logits[r].log_softmax(0)[t]), abs=1e-5)
    assert out.kept_sets[1].num_kept > 1


def test_all_greedy_batch_exports_too():
    logits = random_logits(3, V, seed=6)
    md = _mask_md(3)
    md.all_greedy, md.temperature, md.generators = True, None, {}
    out = sample(logits.clone(), md)
    assert [out.kept_sets[r].ids for r in range(3)] == [[int(t)] for t in logits.argmax(-1)]


def test_banned_tokens_are_never_kept():
    logits = random_logits(2, V, seed=7)
    top = int(logits[0].argmax())
    md = _mask_md(2, banned={0: [top]})
    out = sample(logits.clone(), md)
    assert out.kept_sets[0].num_kept == V - 1 and out.kept_sets[1].num_kept == V
    assert out.kept_sets[1].kept_logmass == pytest.approx(0.0, abs=1e-6)


def test_ids_only_when_asked_and_small_enough():
    logits = random_logits(3, V, seed=8)
    md = _mask_md(3, top_k=[5, 5, 100])
    md.mask_rows, md.mask_max_ids = {0: True, 1: False, 2: True}, 50
    out = sample(logits.clone(), md)
    assert len(out.kept_sets[0].ids) == 5
    assert out.kept_sets[1].ids is None and out.kept_sets[1].num_kept == 5
    assert out.kept_sets[2].ids is None and out.kept_sets[2].num_kept == 100  # over the cap: size only


@pytest.mark.parametrize("case", ["top_k", "top_p", "all three", "none"])
def test_asking_for_the_set_does_not_change_the_draw(case):
    rows = 16
    logits = random_logits(rows, V, seed=9, scale=1.0)
    plain = metadata(rows, generators=seeded(range(rows)), logprobs=0, **CASES[case])
    a = sample(logits.clone(), plain)
    b = sample(logits.clone(), _mask_md(rows, **CASES[case]))
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert a.kept_sets is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["top_k", "top_p", "all three", "none"])
def test_cuda_exports_what_the_cpu_does(case):
    """On CUDA a batch that asks for kept sets takes the torch path (not the Triton sampler, which
    has no per-token set to give), with the same sets as on the CPU, and the drawn token in its set."""
    rows = 8
    logits = random_logits(rows, V, seed=10).bfloat16().float()
    cpu = sample(logits.clone(), _mask_md(rows, **CASES[case]))
    md = _mask_md(rows, **CASES[case])
    md.generators = {}  # (the seeded rows' generators are CPU ones)
    for name in ("temperature", "top_k", "top_p", "min_p"):
        if getattr(md, name) is not None:
            setattr(md, name, getattr(md, name).cuda())
    gpu = sample(logits.cuda(), md)
    for r in range(rows):
        assert gpu.kept_sets[r].ids == cpu.kept_sets[r].ids
        assert gpu.kept_sets[r].min_logprob == pytest.approx(cpu.kept_sets[r].min_logprob, abs=1e-5)
        assert int(gpu.token_ids[r]) in gpu.kept_sets[r].ids
