"""The Triton sampler (kernels/triton_sampling.py `sample`) against its torch reference
(kernels/sampling.py `sample_filtered_ref`): the kept set, the token drawn at many u, its logprob.
In Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU; small
shapes), compiled when a GPU is present. Skipped when triton is not installed."""
import os

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_sampling  # noqa: E402
from kernels.sampling import sample_filtered_ref, sample_ref_filter  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
NEG_INF = float("-inf")
NUM_U = 32  # draws per row of test_draws_and_logprobs_match_torch
TOL = 1e-5  # relative distance to a top-p, min-p or CDF boundary that float rounding may decide

# (temperature, top_k, top_p, min_p), one row each; the odd k cut between two tied copies (_logits)
PARAMS = [
    (1.0, 0, 1.0, 0.0),  # every filter off
    (0.8, 41, 1.0, 0.0),  # top-k only
    (1.2, 0, 0.7, 0.0),  # top-p only
    (1.0, 0, 1.0, 0.05),  # min-p only
    (0.9, 31, 0.9, 0.02),  # all three
    (1.0, 1 << 20, 0.95, 0.0),  # k beyond the vocabulary: off
    (1.0, 1, 1.0, 0.0),  # k = 1: the max and its ties
    (1e-3, 0, 0.6, 0.0),  # tiny temperature: the tied maxima share all the mass
]


def _logits(V: int, kind: str, seed: int) -> torch.Tensor:
    """(len(PARAMS), V). "f32": continuous, with each row's 64 largest copied once elsewhere (ties at
    the max and at top-k's cut); "f32q": multiples of 1/32 (ties everywhere, at top-p's cut too);
    "bf16": bf16's own rounding (the same). Rows 0 and 2 start with 1100 banned tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(PARAMS), V, generator=g) * 2.5
    if kind == "f32":
        for row in x:
            top = row.topk(64)
            perm = torch.randperm(V, generator=g)
            row[perm[~torch.isin(perm, top.indices)][:64]] = top.values
    elif kind == "f32q":
        x = (x * 32).round() / 32
    x[[0, 2], :1100] = NEG_INF  # banned tokens, a whole block of them: drawn never
    if kind != "bf16":  # two tokens 2e-4 either side of min-p's cut (p = min_p * p_max)
        x[3, 5:7] = x[3].max() + torch.tensor(PARAMS[3][3]).log() + torch.tensor([2e-4, -2e-4])
    return x.to(DEVICE, torch.bfloat16 if kind == "bf16" else torch.float32)


def _params(rows: list[int], repeat: int = 1) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p, min_p tensors for PARAMS[rows], each row repeated."""
    cols = list(zip(*[PARAMS[r] for r in rows for _ in range(repeat)]))
    dtypes = (torch.float32, torch.int64, torch.float32, torch.float32)
    return tuple(torch.tensor(c, dtype=d, device=DEVICE) for c, d in zip(cols, dtypes))


def _scaled(logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(len(PARAMS), V) on the CPU: logits / each row's temperature, in dtype (as torch divides)."""
    return logits.cpu().to(dtype) / torch.tensor([p[0] for p in PARAMS], dtype=dtype)[:, None]


def _ref_filtered(logits: torch.Tensor) -> torch.Tensor:
    """(len(PARAMS), V) float32: logits / temperature with the reference filter's -inf, per row."""
    x = _scaled(logits)
    return torch.stack([sample_ref_filter(row, 1.0, min(k, row.numel()), p, mp, stable=True)
                        for row, (_, k, p, mp) in zip(x, PARAMS)])


def _ambiguous(logits: torch.Tensor) -> torch.Tensor:
    """(len(PARAMS), V) bool: tokens whose top-p or min-p verdict lies within TOL of the cut, where
    the kernel's and torch's float sums may differ (measured in float64)."""
    x = _scaled(logits, torch.float64)
    out = torch.zeros(x.shape, dtype=torch.bool)
    for i, (row, (_, k, top_p, min_p)) in enumerate(zip(x, PARAMS)):
        if 0 < k < row.numel():
            row = row.masked_fill(row < row.topk(k).values[-1], NEG_INF)
        if top_p < 1:
            sorted_x, order = row.sort(descending=True, stable=True)
            p = sorted_x.softmax(-1)
            out[i, order] |= ((p.cumsum(-1) - p) - top_p).abs() <= TOL * top_p
        if min_p > 0:
            out[i] |= ((row - row.max()).exp() - min_p).abs() <= TOL * min_p
    return out


def _top_p_splits_a_tie(logits: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether some row keeps part of a group of equal values (only top-p does: by rank)."""
    x = _scaled(logits)
    cut = x.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)  # each row's smallest kept value
    return bool(((x == cut) & ~keep).any())


# (V, kind, seed): V past one 1024-token block and not a multiple of it; seeds where top-p cuts
# through a group of ties
CASES = [(2500, "f32", 2502), (2000, "f32q", 2000), (3000, "bf16", 3002)]


@pytest.mark.parametrize("V,kind,seed", CASES)
def test_kept_set_matches_torch(V, kind, seed):
    logits = _logits(V, kind, seed)
    keep = triton_sampling.filter_mask(logits, *_params(list(range(len(PARAMS))))).cpu()
    want = _ref_filtered(logits) != NEG_INF
    differ = keep != want
    assert not (differ & ~_ambiguous(logits)).any(), \
        f"rows {differ.any(-1).nonzero().flatten().tolist()} differ from torch's filter"
    assert differ.sum() <= 2  # (float64 says these are too close to call; they stay rare)
    # the rows test what they are there for
    counts = want.sum(-1).tolist()
    assert counts[0] == V - 1100 and counts[5] < V  # all off but the banned; k past V, top-p still on
    if kind == "f32":  # the 41st and 42nd largest are copies, as are the two largest: kept in pairs
        assert counts[1] == 42 and counts[6] == 2 and counts[7] == 2
    if kind != "bf16":
        assert want[3, 5] and not want[3, 6]
    assert _top_p_splits_a_tie(logits, want)


@pytest.mark.parametrize("kind", ["f32q", "bf16"])
def test_draws_and_logprobs_match_torch(kind):
    """Every row drawn at NUM_U u (0, tiny, stratified, near 1), batched as rows of the same logits."""
    V, rows = 1500, len(PARAMS)
    g = torch.Generator().manual_seed(1)
    u = torch.cat([torch.tensor([0.0, 1e-7, 0.999, 1 - 2 ** -24]),
                   (torch.arange(NUM_U - 4) + torch.rand(NUM_U - 4, generator=g)) / (NUM_U - 4)]).float()
    base = _logits(V, kind, seed=1500)
    logits = base.repeat_interleave(NUM_U, dim=0)  # (rows * NUM_U, V)
    us = u.repeat(rows).to(DEVICE)
    params = _params(list(range(rows)), repeat=NUM_U)
    ids, lps = triton_sampling.sample(logits, *params, us, True)
    want_ids, want_lps = sample_filtered_ref(logits.cpu(), *(p.cpu() for p in params), us.cpu(), True)
    ids, lps, us = ids.cpu(), lps.cpu(), us.cpu().double()
    filtered = _ref_filtered(base)
    assert _top_p_splits_a_tie(base, filtered != NEG_INF)
    filtered = filtered.repeat_interleave(NUM_U, dim=0)
    kept = filtered > NEG_INF
    assert kept.gather(1, ids[:, None]).all(), "a draw outside the kept set"
    # every draw is the token whose interval of the reference CDF (float64, vocabulary order) holds u
    probs = filtered.double().softmax(-1)
    cdf = probs.cumsum(-1)
    at = cdf.gather(1, ids[:, None]).squeeze(1)
    before = at - probs.gather(1, ids[:, None]).squeeze(1)
    tol = TOL * us + 1e-9
    assert ((before - tol <= us) & (us < at + tol)).all(), "a draw outside u's interval of the CDF"
    # and is torch's, unless u is within TOL of a boundary of the CDF (its end included)
    near = (cdf - us[:, None]).abs().masked_fill(~kept, 1.0).amin(-1) <= tol
    bad = (ids != want_ids) & ~near
    assert not bad.any(), f"draws differ from torch's at (row, u) {[(i // NUM_U, float(us[i])) for i in bad.nonzero()]}"
    assert near.sum() <= 2 * rows  # (u = 1 - 2^-24 is near the CDF's end in every row)
    assert len(set(ids.tolist())) > 2 * rows  # the u's reach many tokens
    # the logprob under the filtered distribution; float32 steps of m + log z grow with the row's max
    same = ids == want_ids
    tol_lp = TOL + 1e-6 * filtered.masked_fill(~kept, 0).abs().amax(-1)
    assert ((lps - want_lps).abs() <= tol_lp)[same].all()


def test_draws_without_logprobs_are_the_same():
    logits = _logits(1500, "f32", seed=3)
    args = (logits, *_params(list(range(len(PARAMS)))), torch.full((len(PARAMS),), 0.5, device=DEVICE))
    ids, lps = triton_sampling.sample(*args, False)
    assert lps is None and ids.dtype == torch.int64 and torch.equal(ids, triton_sampling.sample(*args, True)[0])


def test_engine_sampler_takes_the_same_tokens_through_triton():
    """kernels.sampling.sample's Triton path (taken for CUDA logits; called directly here) against
    its torch path on one batch: greedy, filtered, seeded and banned-token rows, logprobs on."""
    from kernels.sampling import SamplingMetadata, _sample_triton, sample

    V = 1000
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(7)) * 3

    def metadata(device="cpu"):  # (the engine builds it on the logits' device; seeded generators stay on the host)
        return SamplingMetadata(
            num_rows=5, all_greedy=False, temperature=torch.tensor([1.0, 0.7, 1.1, 0.9, 1.0], device=device),
            greedy=torch.tensor([True, False, False, False, False], device=device),
            top_k=torch.tensor([0, 20, 0, 0, 50], device=device),
            top_p=torch.tensor([1.0, 1.0, 0.8, 1.0, 0.9], device=device),
            min_p=torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0], device=device),
            generators={3: torch.Generator().manual_seed(11)}, max_num_logprobs=0,
            banned_tokens={2: list(range(0, V, 3))})

    for seed in range(4):
        want = sample(logits.clone(), metadata(), torch.Generator().manual_seed(seed))
        got = _sample_triton(logits.clone().to(DEVICE), metadata(DEVICE), torch.Generator().manual_seed(seed))
        assert torch.equal(got.token_ids.cpu(), want.token_ids)
        torch.testing.assert_close(got.logprobs.cpu(), want.logprobs, rtol=1e-5, atol=1e-5)
        assert int(want.token_ids[0]) == int(logits[0].argmax()) and int(want.token_ids[2]) % 3 != 0
