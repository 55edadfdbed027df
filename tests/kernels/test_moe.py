"""kernels/moe.py: the C++ fused experts (kernels/csrc/moe.cpp) against the torch reference
`fused_experts_torch` and against transformers' Qwen3-MoE and Mixtral sparse MoE blocks; `route`
against both models' routers; the dispatcher and its fallback.

Tolerances: float32 up to the order of the matmuls' float32 sums (rtol 1e-5). bfloat16: the op
rounds where the reference's torch ops round, so most elements are equal and the rest differ
where a dot product's float32 sum order moved a value across a bf16 rounding boundary (then by
an ulp or so of that intermediate, carried through the down projection): we ask for >= 95% equal
elements and every difference within 2^-6 of the output's largest magnitude."""
import threading

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext, moe
from kernels.moe import fused_experts_torch, route

# (T, H, I, E, k): sizes not multiples of 8/16/32 (vector tails), decode (T=1), k=1, and one big
# enough for the two-thread path (> 2^18 multiply-adds)
SHAPES = [(1, 64, 32, 8, 2), (7, 67, 45, 6, 3), (5, 40, 24, 4, 1), (33, 96, 80, 16, 4), (3, 17, 5, 3, 2)]


def _case(T, H, I, E, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.3).to(dtype)
    ids, weights = route(torch.randn(T, E, generator=g), k, True)
    return x, w13, w2, ids, weights


def assert_matches(got, want, rtol: float = 1e-5):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.numel() == 0:
        return
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())
        return
    g, w = got.float(), want.float()
    assert (g == w).float().mean().item() >= 0.95, f"only {(g == w).float().mean().item():.3f} of elements equal"
    assert (g - w).abs().max().item() <= 2 ** -6 * w.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-k{}".format(*s))
def test_matches_reference(ext, dtype, shape):
    x, w13, w2, ids, weights = _case(*shape, dtype)
    assert_matches(ext.fused_experts(x, w13, w2, ids, weights), fused_experts_torch(x, w13, w2, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ids_outside_the_local_experts_add_nothing(ext, dtype):
    """Expert parallelism passes the ids of experts held elsewhere as -1 (or >= E): a token whose
    ids are all such gets zeros; the others sum only their local experts."""
    x, w13, w2, ids, weights = _case(6, 48, 40, 5, 3, dtype)
    ids[0, 1] = -1
    ids[2] = torch.tensor([-1, 5, 99], dtype=torch.int32)  # none local
    ids[4, 0] = 7
    got = ext.fused_experts(x, w13, w2, ids, weights)
    assert_matches(got, fused_experts_torch(x, w13, w2, ids, weights))
    assert not got[2].any()
    keep = (ids >= 0) & (ids < 5)  # the same as weight 0 on the foreign pairs
    want = fused_experts_torch(x, w13, w2, torch.where(keep, ids, 0), torch.where(keep, weights, 0.0))
    assert_matches(got, want)


def test_experts_without_tokens_duplicates_and_int64_ids(ext):
    """Experts 0, 2 and 5 get no token (the prefetch of 'the next active expert' skips them); a
    token may name one expert twice (added twice, in slot order); int64 ids as the EP path passes."""
    x, w13, w2, _, weights = _case(4, 40, 24, 6, 2, torch.float32)
    ids = torch.tensor([[1, 3], [4, 4], [3, 1], [1, 1]], dtype=torch.int64)
    got = ext.fused_experts(x, w13, w2, ids, weights)
    assert_matches(got, fused_experts_torch(x, w13, w2, ids, weights))
    assert torch.equal(got, ext.fused_experts(x, w13, w2, ids.int(), weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens(ext, dtype):
    x, w13, w2, ids, weights = _case(0, 32, 16, 4, 2, dtype)
    out = ext.fused_experts(x, w13, w2, ids, weights)
    assert out.shape == (0, 32) and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_in_any_batch(ext, dtype):
    """Each output element is one dot product computed the same way wherever its token sits, and
    each token's sum runs in expert id order: alone, in a batch, or with the batch reordered, a
    token's output is bitwise the same (the torch reference's matmuls do not promise this)."""
    x, w13, w2, ids, weights = _case(33, 96, 80, 16, 4, dtype, seed=3)
    batch = ext.fused_experts(x, w13, w2, ids, weights)
    for t in (0, 7, 32):
        assert torch.equal(ext.fused_experts(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1]), batch[t:t + 1])
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ext.fused_experts(x[perm], w13, w2, ids[perm], weights[perm]), batch[perm])
    slots = torch.randperm(4, generator=torch.Generator().manual_seed(2))  # slot order does not matter either
    assert torch.equal(ext.fused_experts(x, w13, w2, ids[:, slots], weights[:, slots]), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_pairs_than_one_pass_takes(ext, dtype):
    """Past 8192 (token, expert) pairs the op works through the tokens in chunks (bounded
    scratch): the result is the reference's, and a token at a chunk's edge gets its own bits."""
    x, w13, w2, ids, weights = _case(2100, 24, 12, 5, 4, dtype)  # 8400 pairs: two chunks of 2048 tokens + 4
    got = ext.fused_experts(x, w13, w2, ids, weights)
    assert_matches(got, fused_experts_torch(x, w13, w2, ids, weights))
    for t in (2047, 2048, 2099):
        assert torch.equal(ext.fused_experts(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1]), got[t:t + 1])


def test_strided_rows_of_x(ext):
    x, w13, w2, ids, weights = _case(5, 40, 24, 4, 2, torch.float32)
    wide = torch.cat([x, torch.ones_like(x)], dim=1)[:, :40]  # row stride 80
    assert torch.equal(ext.fused_experts(wide, w13, w2, ids, weights), ext.fused_experts(x, w13, w2, ids, weights))


def test_concurrent_calls_agree_with_serial_ones(ext):
    cases = [_case(9, 64, 48, 8, 2, dt, seed=s) for s, dt in enumerate([torch.float32, torch.bfloat16] * 3)]
    want = [ext.fused_experts(*c) for c in cases]
    got, errors = [None] * len(cases), []

    def call(i):
        try:
            for _ in range(5):
                got[i] = ext.fused_experts(*cases[i])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_input_names_the_argument(ext):
    x, w13, w2, ids, weights = _case(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="w2 must be"):
        ext.fused_experts(x, w13, w2[:, :, :8].contiguous(), ids, weights)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ext.fused_experts(x, w13.bfloat16(), w2, ids, weights)
    with pytest.raises(RuntimeError, match="topk_ids must be"):
        ext.fused_experts(x, w13, w2, ids.float(), weights)
    with pytest.raises(RuntimeError, match="topk_weights must be"):
        ext.fused_experts(x, w13, w2, ids, weights[:, :1])


def test_dispatch_runs_the_cpp_op_and_falls_back(ext, monkeypatch):
    x, w13, w2, ids, weights = _case(7, 67, 45, 6, 3, torch.float32)
    assert torch.equal(moe.fused_experts(x, w13, w2, ids, weights), ext.fused_experts(x, w13, w2, ids, weights))
    monkeypatch.setattr(cpu_ext, "ops_for", lambda device, dtype: None)  # no extension: the reference
    assert torch.equal(moe.fused_experts(x, w13, w2, ids, weights), fused_experts_torch(x, w13, w2, ids, weights))


def test_dispatch_falls_back_for_layouts_the_op_does_not_take(ext):
    x, w13, w2, ids, weights = _case(5, 40, 24, 4, 2, torch.float32)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert torch.equal(moe.fused_experts(x, w13_t, w2, ids, weights), fused_experts_torch(x, w13_t, w2, ids, weights))


# ---- against transformers' blocks ------------------------------------------------------------

def _qwen3_block(norm_topk_prob: bool, E=8, k=2, H=64, I=40):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=norm_topk_prob, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1)
    cfg._experts_implementation = "eager"
    return _init(Qwen3MoeSparseMoeBlock(cfg), seed=int(norm_topk_prob)), k, norm_topk_prob


def _mixtral_block(E=6, k=2, H=48, I=36):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    cfg._experts_implementation = "eager"
    return _init(MixtralSparseMoeBlock(cfg), seed=7), k, True


def _init(block, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block.eval()


BLOCKS = {"qwen3-norm": lambda: _qwen3_block(True), "qwen3-no-norm": lambda: _qwen3_block(False),
          "mixtral": _mixtral_block}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_route_matches_the_routers(name):
    block, k, renormalize = BLOCKS[name]()
    x = torch.randn(11, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, want_weights, want_ids = block.gate(x)
    ids, weights = route(logits, k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    assert torch.equal(weights, want_weights.float())


@pytest.mark.parametrize("name", list(BLOCKS))
def test_fused_experts_matches_the_blocks(ext, name):
    block, k, renormalize = BLOCKS[name]()
    H = block.gate.weight.shape[1]
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = block(x).reshape(-1, H)
        flat = x.reshape(-1, H)
        ids, weights = route(F.linear(flat, block.gate.weight), k, renormalize)
        w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
        assert torch.equal(fused_experts_torch(flat, w13, w2, ids, weights), want)  # the reference: bitwise
        got = ext.fused_experts(flat, w13, w2, ids, weights)
        assert_matches(got, want)
        assert_matches(moe.fused_experts(flat, w13, w2, ids, weights), want)


def test_fused_experts_matches_qwen3_in_bfloat16(ext):
    """Qwen3-MoE's router casts the weights to the model dtype before the experts multiply, as
    fused_experts does with its float32 weights."""
    block, k, renormalize = _qwen3_block(True)
    block = block.to(torch.bfloat16)
    H = block.gate.weight.shape[1]
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    with torch.no_grad():
        want = block(x[None])[0]
        ids, weights = route(F.linear(x, block.gate.weight), k, renormalize)
        got = ext.fused_experts(x, block.experts.gate_up_proj, block.experts.down_proj, ids, weights)
    assert_matches(got, want)
