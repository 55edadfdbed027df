"""write_many (kernels/csrc/spare_write.cpp), a trainer's write into a leased weight spare in one
call: every pack it runs equals the pack function of that name on its own (ragged N and K, every
layout this CPU builds; sources that are column slices of a wider tensor, as a tensor-parallel
rank's share of a row-parallel weight), its copies are byte-exact at any length and alignment (the streamed
stores start at a line boundary), float32 sources of bfloat16 destinations (copies and packs) are
rounded exactly as torch's cast rounds them, one call with 1 and 2 threads writes the same bytes,
and bad jobs are refused before anything is written."""
import pytest
import torch

PACKS = [("f32_panel_pack", torch.float32), ("bf16_vnni_pack", torch.bfloat16), ("bf16_panel_pack", torch.bfloat16)]


def _packs_here(ext) -> list[tuple[str, torch.dtype]]:
    return [(fn, dt) for fn, dt in PACKS if fn != "bf16_panel_pack" or ext.f32_panel_supported()]


def _jobs(ext, seed: int):
    """(sources, destinations full of other bytes, packs, what each destination must hold)."""
    g = torch.Generator().manual_seed(seed)
    srcs, dsts, packs, want = [], [], [], []
    for fn, dt in _packs_here(ext):
        for n, k in [(64, 96), (45, 33), (1728, 576), (17, 1)]:
            w = torch.randn(n, k, generator=g).to(dt)
            ref = getattr(ext, fn)(w)
            srcs.append(w), dsts.append(torch.full_like(ref, 3.0)), packs.append(fn), want.append(ref)
        for n, k, first in [(64, 96, 96), (45, 33, 7), (576, 384, 192)]:  # column slices: rows apart by more than k
            w = torch.randn(n, first + k + 5, generator=g).to(dt)[:, first:first + k]
            ref = getattr(ext, fn)(w.contiguous())
            srcs.append(w), dsts.append(torch.full_like(ref, 3.0)), packs.append(fn), want.append(ref)
    buf = torch.randn(1 << 20, generator=g)  # copies at odd offsets and lengths, and a large one
    for start, length in [(0, 1), (3, 17), (5, 70000), (16, (1 << 20) - 16)]:
        src = buf[start:start + length].clone()
        out = torch.full((length + 40,), 9.0)[start % 7:start % 7 + length]  # (misaligned)
        srcs.append(src), dsts.append(out), packs.append(""), want.append(src.clone())
    half = torch.randn(3001, generator=g).bfloat16()
    srcs.append(half), dsts.append(torch.zeros_like(half)), packs.append(""), want.append(half.clone())
    for fn, dt in _packs_here(ext):  # float32 masters into a bf16 engine's panels: cast, then packed
        if dt == torch.bfloat16:
            for n, k, first in [(64, 96, 0), (45, 33, 0), (1728, 576, 0), (64, 96, 32), (45, 33, 3)]:
                w = (torch.randn(n, first + k + 2, generator=g) * 3)[:, first:first + k]
                ref = getattr(ext, fn)(w.bfloat16())
                srcs.append(w), dsts.append(torch.full_like(ref, 3.0)), packs.append(fn), want.append(ref)
            w = _hard_floats(64 * 97, g).view(64, 97)[:, 1:]  # (the cast's hard cases inside the pack too)
            ref = getattr(ext, fn)(w.bfloat16())
            srcs.append(w), dsts.append(torch.full_like(ref, 3.0)), packs.append(fn), want.append(ref)
    for length in (1, 70001):
        src = _hard_floats(length, g)
        srcs.append(src), dsts.append(torch.zeros(length, dtype=torch.bfloat16)), packs.append("")
        want.append(src.bfloat16())
    return srcs, dsts, packs, want


def _hard_floats(n: int, g) -> torch.Tensor:
    """Values whose rounding to bf16 is easy to get wrong: ties both ways, denormals, the largest
    finite values (rounding to inf), infinities, signed zeros; random bits around them."""
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e-40, -3e-39, 2 ** -149, 3.4e38, -3.39e38,
                            float("inf"), float("-inf"), 0.0, -0.0, 1.0, 65504.0])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[x.isnan()] = 1.5
    x[: min(n, len(special))] = special[:n]
    return x


@pytest.mark.parametrize("threads", [1, 2])
def test_every_job_lands_as_its_own_pack_or_copy(ext, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        srcs, dsts, packs, want = _jobs(ext, threads)
        ext.write_many(srcs, dsts, packs)
    finally:
        torch.set_num_threads(before)
    for i, (d, w) in enumerate(zip(dsts, want)):
        assert torch.equal(d, w), (i, packs[i], tuple(srcs[i].shape))


def test_bad_jobs_are_refused_before_any_write(ext):
    good_src, good_dst = torch.randn(64, 32), torch.zeros(2, 32, 32)
    cases = [
        (torch.randn(64, 32), torch.zeros(2, 32, 31), "f32_panel_pack", "writes"),  # wrong packed shape
        (torch.randn(64, 32).bfloat16(), torch.zeros(2, 32, 32).bfloat16(), "f32_panel_pack", "packs float32"),
        (torch.randn(64, 32), torch.zeros(2, 32, 32), "a_pack", "unknown pack"),
        (torch.randn(10), torch.zeros(11), "", "as many elements"),
        (torch.randn(10), torch.zeros(9).bfloat16(), "", "as many elements"),  # (a cast: counted in elements)
        (torch.randn(10).bfloat16(), torch.zeros(10), "", "one dtype"),  # only float32 -> bfloat16 casts
        (torch.randn(4, 8).t(), torch.zeros(32), "", "contiguous"),
        (torch.randn(32, 64).t(), torch.zeros(2, 32, 32), "f32_panel_pack", "rows contiguous"),
        (torch.randn(64, 64)[:, ::2], torch.zeros(2, 32, 32), "f32_panel_pack", "rows contiguous"),
    ]
    for src, dst, pack, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ext.write_many([good_src, src], [good_dst, dst], ["f32_panel_pack", pack])
        assert not good_dst.any(), message  # the good job before it was not written either
    with pytest.raises(RuntimeError, match="as many"):
        ext.write_many([good_src], [good_dst, good_dst], ["f32_panel_pack"])


@pytest.mark.parametrize("offset", [0, 1])  # (a destination off the vector stores' alignment too)
def test_a_cast_makes_nan_a_nan(ext, offset):
    src = torch.randn(100, generator=torch.Generator().manual_seed(0))
    nans = [0, 1, 17, 50, 99]  # (in vector lanes and in the scalar tail)
    src[nans] = torch.tensor([float("nan"), -float("nan")] * 2 + [float("nan")])
    dst = torch.zeros(100 + offset, dtype=torch.bfloat16)[offset:]
    ext.write_many([src], [dst], [""])
    assert dst[nans].isnan().all()
    rest = [i for i in range(100) if i not in nans]
    assert torch.equal(dst[rest], src[rest].bfloat16())
