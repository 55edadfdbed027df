"""The Triton fused-MoE kernels (kernels/triton_moe.py) against the torch reference
`fused_experts_torch`: in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU; small shapes), compiled when a GPU is present. Skipped when triton is not installed.

Tolerances: float32 up to the order of the float32 sums (and, on a GPU, tl.exp's and the
division's approximations): rtol 1e-5 in the interpreter, 1e-4 compiled. bfloat16: the kernels
round where the reference's torch ops round (round-to-nearest-even spelled out, so the
interpreter's truncating cast does not matter), so most elements are equal; the rest moved by a
different float32 sum order across a bf16 rounding boundary: >= 95% equal, every difference
within 2^-6 of the output's largest magnitude."""
import os

import pytest
import torch

pytest.importorskip("triton")

from kernels import moe, triton_moe  # noqa: E402
from kernels.moe import fused_experts_torch  # noqa: E402
from tests.kernels.test_moe import _case as cpu_case  # noqa: E402
from tests.kernels.test_moe import assert_matches as assert_close_to  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

# (T, H, I, E, k): odd sizes (masked tails of every block), decode, k = 1, more pairs than BLOCK_M
SHAPES = [(1, 64, 32, 8, 2), (7, 67, 45, 6, 3), (20, 40, 24, 4, 1)]


def _case(T, H, I, E, k, dtype, seed=0):
    return [t.to(DEVICE) for t in cpu_case(T, H, I, E, k, dtype, seed)]


def assert_matches(got, want):
    assert_close_to(got, want, rtol=1e-5 if DEVICE == "cpu" else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-k{}".format(*s))
def test_matches_reference(dtype, shape):
    x, w13, w2, ids, weights = _case(*shape, dtype)
    assert_matches(triton_moe.fused_experts(x, w13, w2, ids, weights), fused_experts_torch(x, w13, w2, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreign_ids_idle_experts_and_duplicates(dtype):
    """-1 / >= E ids add nothing (a token with none local gets zeros); experts 0 and 2 get no
    token; a token naming one expert twice gets it twice."""
    x, w13, w2, _, weights = _case(5, 40, 24, 6, 2, dtype)
    ids = torch.tensor([[1, 3], [-1, 4], [9, -1], [4, 4], [5, 1]], dtype=torch.int32, device=DEVICE)
    got = triton_moe.fused_experts(x, w13, w2, ids, weights)
    assert_matches(got, fused_experts_torch(x, w13, w2, ids, weights))
    assert not got[2].any()


def test_no_tokens():
    x, w13, w2, ids, weights = _case(0, 32, 16, 4, 2, torch.float32)
    assert triton_moe.fused_experts(x, w13, w2, ids, weights).shape == (0, 32)


def test_a_token_gets_the_same_result_alone_and_in_a_batch():
    """Fixed tile shapes: a token's rows meet the same tiles whatever else is in the batch (up to
    tl.dot's own guarantees, so compared with a tolerance here and bitwise in the interpreter)."""
    x, w13, w2, ids, weights = _case(20, 40, 24, 4, 2, torch.float32, seed=4)
    batch = triton_moe.fused_experts(x, w13, w2, ids, weights)
    alone = triton_moe.fused_experts(x[5:6], w13, w2, ids[5:6], weights[5:6])
    if DEVICE == "cpu":
        assert torch.equal(alone, batch[5:6])
    else:
        torch.testing.assert_close(alone, batch[5:6], rtol=1e-5, atol=1e-5)


def test_align_block_size():
    """Every block belongs to one expert; each held pair appears once, in (expert, token) order;
    padding holds T * k; blocks past the last run are -1."""
    ids = torch.tensor([[2, 0], [2, -1], [0, 5], [1, 2]], device=DEVICE)
    sorted_pairs, block_expert = triton_moe.align_block_size(ids, 4, 4)
    P = ids.numel()
    sp, be = sorted_pairs.cpu().view(-1, 4), block_expert.cpu()
    assert be.tolist()[:3] == [0, 1, 2] and all(e == -1 for e in be.tolist()[3:])
    assert sp[0].tolist() == [1, 4, P, P]  # expert 0: pairs of tokens 0 and 2
    assert sp[1].tolist() == [6, P, P, P]
    assert sp[2].tolist() == [0, 2, 7, P]  # expert 2: tokens 0, 1, 3
    assert (sp[3:] == P).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatcher sends CUDA tensors to the Triton kernels")
def test_dispatcher_runs_triton_on_cuda():
    x, w13, w2, ids, weights = _case(7, 67, 45, 6, 3, torch.bfloat16)
    assert torch.equal(moe.fused_experts(x, w13, w2, ids, weights), triton_moe.fused_experts(x, w13, w2, ids, weights))
