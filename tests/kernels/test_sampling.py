"""The sampler on random logits: seeds, the top-k / top-p / min-p filters against the readable
reference, temperature statistics, greedy rows, logprobs, banned tokens."""
import math
import zlib

import pytest
import torch

from kernels.sampling import SamplingMetadata, filter_logits, sample, sample_ref_filter

NEG_INF = float("-inf")


def random_logits(rows, vocab, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def metadata(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=None, generators=None,
             logprobs=None, raw=None, banned=None) -> SamplingMetadata:
    """Per-row values may be scalars (same for every row) or lists."""
    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * rows, dtype=dtype)

    md = SamplingMetadata(num_rows=rows, all_greedy=False, temperature=col(temperature, torch.float32))
    if greedy is not None:
        md.greedy = torch.tensor(greedy, dtype=torch.bool)
    if top_k != 0:
        md.top_k = col(top_k, torch.int64)
    if top_p != 1.0:
        md.top_p = col(top_p, torch.float32)
    if min_p != 0.0:
        md.min_p = col(min_p, torch.float32)
    md.generators = generators or {}
    md.max_num_logprobs = logprobs
    if raw is not None:
        md.raw_logprobs = torch.tensor(raw if isinstance(raw, list) else [raw] * rows, dtype=torch.bool)
    md.banned_tokens = banned or {}
    return md


def seeded(seeds):
    return {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}


# ---- (a) seeds ------------------------------------------------------------------------------
def test_seeded_rows_are_reproducible_and_independent_of_the_batch_generator():
    logits = random_logits(64, 50, seed=0, scale=0.5)  # flat: many plausible tokens per row
    seeds = list(range(100, 164))
    t1 = sample(logits.clone(), metadata(64, generators=seeded(seeds)), torch.Generator().manual_seed(1)).token_ids
    t2 = sample(logits.clone(), metadata(64, generators=seeded(seeds)), torch.Generator().manual_seed(2)).token_ids
    assert torch.equal(t1, t2)
    # a different seed for every row: the draws differ
    t3 = sample(logits.clone(), metadata(64, generators=seeded([s + 1000 for s in seeds]))).token_ids
    assert (t3 != t1).sum() > 32


def test_seeded_row_does_not_depend_on_its_neighbours():
    logits = random_logits(8, 50, seed=1, scale=0.5)
    gens = {3: torch.Generator().manual_seed(7)}
    a = sample(logits.clone(), metadata(8, generators=gens)).token_ids[3]
    other = logits.clone()
    other[[0, 1, 2, 4, 5, 6, 7]] = random_logits(7, 50, seed=2)
    b = sample(other, metadata(8, generators={3: torch.Generator().manual_seed(7)}), torch.Generator().manual_seed(9))
    assert a == b.token_ids[3]


def test_seeded_generator_advances_between_steps():
    logits = random_logits(1, 50, seed=3, scale=0.1).expand(1, 50).contiguous()
    g = torch.Generator().manual_seed(5)
    draws = [int(sample(logits.clone(), metadata(1, generators={0: g})).token_ids[0]) for _ in range(20)]
    assert len(set(draws)) > 5  # not the same token every step
    g = torch.Generator().manual_seed(5)
    again = [int(sample(logits.clone(), metadata(1, generators={0: g})).token_ids[0]) for _ in range(20)]
    assert draws == again


# ---- (b) filters ----------------------------------------------------------------------------
FILTER_CASES = [
    dict(top_k=1), dict(top_k=5), dict(top_k=40),
    dict(top_p=0.1), dict(top_p=0.5), dict(top_p=0.9),
    dict(min_p=0.05), dict(min_p=0.3), dict(min_p=0.9),
    dict(top_k=10, top_p=0.8), dict(top_k=20, min_p=0.1), dict(top_p=0.7, min_p=0.2),
    dict(top_k=30, top_p=0.95, min_p=0.02),
]


def ref_keep(logits, T, top_k=0, top_p=1.0, min_p=0.0):
    """(N, V) bool: tokens the reference filter keeps, row by row."""
    return torch.stack([sample_ref_filter(row, T, top_k, top_p, min_p) != NEG_INF for row in logits])


@pytest.mark.parametrize("T", [0.7, 1.3])
@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filters_never_emit_excluded_tokens(case, T):
    rows, vocab, reps = 64, 100, 100
    logits = random_logits(rows, vocab, seed=zlib.crc32(repr((case, T)).encode()), scale=2.0)
    keep = ref_keep(logits, T, **case)
    assert keep.any(dim=-1).all()
    # filter_logits (after temperature) excludes exactly the reference's set
    got = filter_logits(logits / T, metadata(rows, temperature=T, **case)) != NEG_INF
    assert torch.equal(got, keep), f"rows differ: {(got != keep).any(-1).nonzero().flatten().tolist()}"
    # thousands of draws, all inside the kept set
    batch = logits.repeat(reps, 1)
    tokens = sample(batch.clone(), metadata(rows * reps, temperature=T, **case), torch.Generator().manual_seed(0)).token_ids
    ok = keep.repeat(reps, 1).gather(1, tokens[:, None]).squeeze(1)
    assert ok.all(), f"{int((~ok).sum())} samples outside the filtered set"
    single = keep.sum(-1).repeat(reps) == 1  # rows where only the best token survives
    assert torch.equal(tokens[single], batch.argmax(-1)[single])
    if case.get("top_k") == 1:
        assert single.all()


@pytest.mark.parametrize("T", [0.7, 1.3])
def test_mixed_filters_per_row_match_reference(T):
    """One batch, every row its own filter (including rows with every filter off)."""
    rows, vocab = 48, 200
    logits = random_logits(rows, vocab, seed=11, scale=2.5)
    g = torch.Generator().manual_seed(12)
    ks = [int(x) for x in torch.randint(0, 30, (rows,), generator=g)]
    ps = [1.0 if i % 4 == 0 else float(x) for i, x in enumerate(torch.rand(rows, generator=g) * 0.9 + 0.05)]
    ms = [0.0 if i % 3 == 0 else float(x) for i, x in enumerate(torch.rand(rows, generator=g) * 0.3)]
    ks[1] = ks[2] = 0
    ps[1], ms[1] = 1.0, 0.0  # row 1: no filter at all
    md = metadata(rows, temperature=T, top_k=ks, top_p=ps, min_p=ms)
    got = filter_logits(logits / T, md) != NEG_INF
    keep = torch.stack([sample_ref_filter(logits[i], T, ks[i], ps[i], ms[i]) != NEG_INF for i in range(rows)])
    bad = (got != keep).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ from the reference (k, p, min_p = {[(ks[i], ps[i], ms[i]) for i in bad]})"
    assert keep[1].all()


def test_top_p_one_in_a_batch_with_top_p_keeps_the_whole_tail():
    """A row with top_p=1 in a batch where another row filters by top-p must keep every token,
    including the far tail whose cumulative mass rounds to 1."""
    vocab = 5000
    logits = random_logits(2, vocab, seed=13, scale=6.0)
    md = metadata(2, top_p=[1.0, 0.5])
    got = filter_logits(logits.clone(), md)
    assert (got[0] != NEG_INF).all(), f"{int((got[0] == NEG_INF).sum())} tokens dropped from a top_p=1 row"


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_top_k_beyond_the_vocabulary_keeps_everything(top_p):
    """SamplingParams accepts any top_k >= 0 (as vLLM does); k >= vocab must filter nothing."""
    vocab = 50
    logits = random_logits(3, vocab, seed=14)
    md = metadata(3, top_k=[vocab, vocab + 1, 10 ** 6], top_p=top_p)
    got = filter_logits(logits.clone(), md) != NEG_INF
    want = torch.stack([sample_ref_filter(row, 1.0, 0, top_p, 0.0) != NEG_INF for row in logits])
    assert torch.equal(got, want)
    sample(logits.clone(), md)  # and sampling does not raise


# ---- (c) temperature statistics -------------------------------------------------------------
@pytest.mark.parametrize("T", [0.7, 1.0, 1.3])
def test_sampling_frequencies_match_softmax(T):
    vocab, n = 10, 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5, -2.0, 0.8])
    p = (logits / T).softmax(-1)
    tokens = sample(logits.repeat(n, 1), metadata(n, temperature=T), torch.Generator().manual_seed(42)).token_ids
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    z = ((freq - p.double()).abs() / sigma)
    assert (z <= 5).all(), f"freq {freq.tolist()} vs p {p.tolist()} (z {z.tolist()})"
    chi2 = float(((freq - p.double()) ** 2 / p.double()).sum() * n)
    assert chi2 < 35.0, f"chi-square {chi2:.1f} with 9 degrees of freedom"  # p ~ 6e-5


def test_filtered_sampling_frequencies_match_renormalized_distribution():
    n = 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.8, 0.2])
    T, k = 0.9, 4
    ref = sample_ref_filter(logits, T, k, 1.0, 0.0)
    p = ref.softmax(-1).double()
    tokens = sample(logits.repeat(n, 1), metadata(n, temperature=T, top_k=k), torch.Generator().manual_seed(3)).token_ids
    freq = torch.bincount(tokens, minlength=8).double() / n
    sigma = (p * (1 - p) / n).sqrt().clamp(min=1e-12)
    assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), f"{freq.tolist()} vs {p.tolist()}"


# ---- (d) greedy -----------------------------------------------------------------------------
def test_greedy_rows_in_a_mixed_batch_are_argmax():
    rows = 32
    logits = random_logits(rows, 300, seed=21, scale=1.0)
    greedy = [i % 2 == 0 for i in range(rows)]
    md = metadata(rows, temperature=[1.0 if g else 1.5 for g in greedy], top_k=[0 if g else 50 for g in greedy],
                  top_p=[1.0 if g else 0.9 for g in greedy], greedy=greedy)
    tokens = sample(logits.clone(), md, torch.Generator().manual_seed(0)).token_ids
    argmax = logits.argmax(-1)
    g = torch.tensor(greedy)
    assert torch.equal(tokens[g], argmax[g])
    assert (tokens[~g] != argmax[~g]).any()  # the sampled rows are not secretly greedy


def test_all_greedy_batch_is_argmax():
    logits = random_logits(16, 300, seed=22)
    md = SamplingMetadata(num_rows=16, all_greedy=True)
    assert torch.equal(sample(logits.clone(), md).token_ids, logits.argmax(-1))


# ---- (e) logprobs ---------------------------------------------------------------------------
@pytest.mark.parametrize("T", [0.7, 1.3])
@pytest.mark.parametrize("case", [dict(), dict(top_k=8), dict(top_p=0.6), dict(min_p=0.1),
                                  dict(top_k=12, top_p=0.9, min_p=0.05)], ids=str)
def test_processed_logprobs_are_log_softmax_of_the_filtered_tempered_logits(case, T):
    rows, vocab, k = 32, 120, 5
    logits = random_logits(rows, vocab, seed=31, scale=2.0)
    out = sample(logits.clone(), metadata(rows, temperature=T, logprobs=k, **case), torch.Generator().manual_seed(0))
    for i in range(rows):
        ref = sample_ref_filter(logits[i], T, case.get("top_k", 0), case.get("top_p", 1.0),
                                case.get("min_p", 0.0)).log_softmax(-1)
        t = int(out.token_ids[i])
        assert ref[t] != NEG_INF
        assert abs(float(out.logprobs[i]) - float(ref[t])) <= 1e-5
        vals, ids = ref.topk(k)
        assert torch.allclose(out.top_logprobs[i], vals, atol=1e-5, rtol=0)
        finite = vals != NEG_INF
        assert torch.equal(out.top_ids[i][finite], ids[finite])
    check_top_logprobs(out)


def test_raw_logprobs_are_log_softmax_of_raw_logits():
    rows, vocab, k = 16, 120, 4
    logits = random_logits(rows, vocab, seed=32, scale=2.0)
    raw = [i % 2 == 0 for i in range(rows)]
    md = metadata(rows, temperature=0.7, top_k=10, logprobs=k, raw=raw)
    out = sample(logits.clone(), md, torch.Generator().manual_seed(0))
    raw_lp = logits.log_softmax(-1)
    for i in range(rows):
        t = int(out.token_ids[i])
        if raw[i]:
            want = raw_lp[i, t]
            assert torch.allclose(out.top_logprobs[i], raw_lp[i].topk(k).values, atol=1e-5, rtol=0)
        else:
            want = sample_ref_filter(logits[i], 0.7, 10, 1.0, 0.0).log_softmax(-1)[t]
        assert abs(float(out.logprobs[i]) - float(want)) <= 1e-5, f"row {i} raw={raw[i]}"
    check_top_logprobs(out)


def test_greedy_logprobs_are_raw_log_softmax():
    logits = random_logits(8, 100, seed=33)
    out = sample(logits.clone(), SamplingMetadata(num_rows=8, all_greedy=True, max_num_logprobs=3))
    lp = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, lp.max(-1).values, atol=1e-5, rtol=0)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    check_top_logprobs(out)


def test_logprobs_zero_gives_sampled_only():
    logits = random_logits(4, 50, seed=34)
    out = sample(logits.clone(), metadata(4, logprobs=0))
    assert out.logprobs is not None and out.logprobs.shape == (4,)
    assert out.top_ids is None and out.top_logprobs is None
    out = sample(logits.clone(), metadata(4))
    assert out.logprobs is None


def check_top_logprobs(out):
    top = out.top_logprobs
    assert (top[:, :-1] >= top[:, 1:]).all(), "top logprobs not sorted descending"
    assert (top <= 1e-6).all()
    # the sampled token's logprob is never above the best one, and matches it where listed
    assert (out.logprobs <= top[:, 0] + 1e-6).all()
    for i in range(top.shape[0]):
        hit = (out.top_ids[i] == out.token_ids[i]).nonzero().flatten()
        if len(hit) and top[i, hit[0]] != NEG_INF:
            assert abs(float(top[i, hit[0]]) - float(out.logprobs[i])) <= 1e-6


# ---- (f) banned tokens ----------------------------------------------------------------------
def test_banned_tokens_are_never_sampled():
    rows, reps, vocab = 16, 100, 40
    logits = random_logits(rows, vocab, seed=41, scale=3.0)
    top3 = logits.topk(3, dim=-1).indices  # ban each row's three most likely tokens
    batch = logits.repeat(reps, 1)
    n = rows * reps
    banned = {i: top3[i % rows].tolist() for i in range(n)}
    greedy = [i % 5 == 0 for i in range(n)]
    md = metadata(n, temperature=1.3, greedy=greedy, banned=banned, top_k=[0 if i % 3 else 5 for i in range(n)])
    tokens = sample(batch.clone(), md, torch.Generator().manual_seed(0)).token_ids
    hit = (top3.repeat(reps, 1) == tokens[:, None]).any(-1)
    assert not hit.any(), f"{int(hit.sum())} banned tokens sampled"
    # greedy rows fall back to the best allowed token
    masked = batch.clone()
    masked.scatter_(1, top3.repeat(reps, 1), NEG_INF)
    g = torch.tensor(greedy)
    assert torch.equal(tokens[g], masked.argmax(-1)[g])
    # all-greedy batches honour bans too
    md = SamplingMetadata(num_rows=rows, all_greedy=True, banned_tokens={i: top3[i].tolist() for i in range(rows)})
    tokens = sample(logits.clone(), md).token_ids
    assert not (top3 == tokens[:, None]).any()


def test_large_batch_statistics_do_not_favour_low_ids():
    """Exponential race sanity: a flat distribution gives every token its share."""
    n, vocab = 20000, 10
    tokens = sample(torch.zeros(n, vocab), metadata(n), torch.Generator().manual_seed(8)).token_ids
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    sigma = math.sqrt(0.1 * 0.9 / n)
    assert ((freq - 0.1).abs() <= 5 * sigma).all(), freq.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 37, 49152])
def test_greedy_op_matches_argmax_and_log_softmax(ext, dtype, vocab):
    """The one-pass C++ greedy op (ids + logprobs, bf16 read without a float32 copy) against
    torch: the first index of the maximum, ties and NaN rows included; an all -inf row gives
    index 0 and a NaN logprob, as torch does."""
    from kernels.sampling import greedy, greedy_ref

    x = random_logits(9, vocab, seed=vocab).to(dtype)
    if vocab > 3:
        x[1, 2] = x[1, vocab - 1] = x[1].max() + 1  # a tie: the first one wins
        x[2, 3] = float("nan")  # torch.argmax picks the (first) NaN
        x[3] = float("-inf")
        x[4, :vocab // 2] = float("-inf")
    for rows in (x, x[::2]):  # contiguous and strided rows
        ids, lps = ext.greedy_logprobs(rows, True)
        ref_ids, ref_lps = greedy_ref(rows, True)
        assert ids.dtype == torch.int64 and lps.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(lps, ref_lps, atol=1e-5, rtol=0, equal_nan=True)
        assert torch.equal(greedy(rows, False)[0], ref_ids) and greedy(rows, False)[1] is None


def test_plain_greedy_batch_takes_bf16_logits_as_they_are():
    logits = random_logits(6, 1000, seed=5).bfloat16()
    md = SamplingMetadata(num_rows=6, all_greedy=True, max_num_logprobs=0)
    out = sample(logits, md)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    torch.testing.assert_close(out.logprobs, logits.float().log_softmax(-1).gather(
        1, out.token_ids[:, None]).squeeze(1), atol=1e-5, rtol=0)
    md.max_num_logprobs = 2  # top-k logprobs: the general path, in float32
    out = sample(logits, md)
    assert out.top_ids.shape == (6, 2) and out.top_logprobs.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 777, 2048, 49152])
def test_cpu_sampler_op_draws_the_torch_paths_tokens(ext, dtype, vocab, monkeypatch):
    """sample() through the C++ op (temperature only) against its torch path at the same u: the
    same tokens, except where u lies within float rounding of a token's CDF boundary, and the same
    logprobs (1e-5). Greedy rows in the batch stay argmax."""
    import kernels.sampling as sampling

    rows = 64
    logits = random_logits(rows, vocab, seed=vocab).to(dtype)
    temps = (torch.rand(rows, generator=torch.Generator().manual_seed(1)) * 1.5 + 0.2).tolist()
    for md_kw in (dict(logprobs=0), dict(greedy=[i % 5 == 0 for i in range(rows)])):
        md = metadata(rows, temperature=temps, **md_kw)
        assert sampling._cpu_sampler(logits, md) is ext
        got = sample(logits.clone(), md, torch.Generator().manual_seed(3))
        with monkeypatch.context() as m:
            m.setattr(sampling, "_cpu_sampler", lambda *_: None)
            want = sample(logits.clone(), md, torch.Generator().manual_seed(3))
        u = torch.rand(rows, generator=torch.Generator().manual_seed(3))
        probs = (logits.float() / md.temperature[:, None]).softmax(-1).double()
        for r in (got.token_ids != want.token_ids).nonzero().flatten().tolist():
            cdf = probs[r].cumsum(0)
            near = cdf[min(got.token_ids[r], want.token_ids[r])]  # the boundary between the two
            assert abs(near.item() - u[r].item()) < 1e-5, (r, got.token_ids[r], want.token_ids[r])
        if "logprobs" in md_kw:
            same = got.token_ids == want.token_ids
            torch.testing.assert_close(got.logprobs[same], want.logprobs[same], atol=1e-5, rtol=0)
        else:
            assert got.logprobs is None
            assert torch.equal(got.token_ids[md.greedy], logits.float().argmax(-1)[md.greedy])


def test_cpu_sampler_op_rejects_bad_rows(ext):
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="temperature"):
        ext.sample_rows(logits, torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="u"):
        ext.sample_rows(logits, torch.ones(2), torch.tensor([0.5, 1.0]))
    with pytest.raises(RuntimeError, match=r"\(N,\)"):
        ext.sample_rows(logits, torch.ones(3), torch.rand(3))
    ids, _ = ext.sample_rows(torch.full((1, 20), float("-inf")), torch.ones(1), torch.rand(1), True)
    assert ids.item() == 0
