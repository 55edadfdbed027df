"""Rotary embeddings against transformers: inverse frequencies and attention factors of every
supported scaling type, and apply_rope against HF's apply_rotary_pos_emb, bit for bit in fp32."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rotary import apply_rope, rope_cos_sin_cache, rope_inv_freq

HEAD_DIM = 64
THETA = 500000.0

CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                              "attention_factor": 0.8},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                    "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn_betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                   "beta_fast": 16, "beta_slow": 2},
}


def hf_config(scaling, head_dim=HEAD_DIM, theta=THETA) -> LlamaConfig:
    """A LlamaConfig whose rope_parameters hold theta plus the scaling dict (transformers 5.x)."""
    params = {"rope_type": "default", "rope_theta": theta}
    params.update(scaling or {})
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=1,
                       max_position_embeddings=16384, rope_parameters=params)


def hf_inv_freq(config: LlamaConfig):
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        fn = ROPE_INIT_FUNCTIONS.get("default", LlamaRotaryEmbedding.compute_default_rope_parameters)
        return fn(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None)


def ours(scaling, head_dim=HEAD_DIM, theta=THETA):
    return rope_inv_freq(head_dim, theta, dict(scaling) if scaling else None)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim, theta", [(HEAD_DIM, THETA), (16, 10000.0), (128, 1000000.0)])
def test_inv_freq_matches_transformers(name, head_dim, theta):
    scaling = CASES[name]
    cfg = hf_config(scaling, head_dim, theta)
    assert cfg.rope_parameters["rope_type"] == (scaling or {}).get("rope_type", "default")
    ref_inv, ref_factor = hf_inv_freq(cfg)
    inv, factor = ours(scaling, head_dim, theta)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,)
    assert torch.equal(inv, ref_inv.float()), f"max diff {(inv - ref_inv).abs().max().item()}"
    assert factor == ref_factor


def test_scaling_types_really_change_the_frequencies():
    base, _ = ours(None)
    for name in ("linear", "llama3", "yarn"):
        assert not torch.equal(ours(CASES[name])[0], base), name
    assert ours(CASES["yarn"])[1] > 1.0
    assert ours(CASES["yarn_attention_factor"])[1] == 0.8


def test_linear_is_default_divided_by_factor():
    inv, _ = ours({"rope_type": "linear", "factor": 2.0})
    assert torch.equal(inv, ours(None)[0] / 2.0)


def test_cos_sin_cache_matches_hf_rotary_embedding():
    for name in ("default", "llama3", "yarn", "yarn_mscale"):
        cfg = hf_config(CASES[name])
        rotary = LlamaRotaryEmbedding(cfg)
        positions = torch.arange(300)[None, :]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # (1, L, D)
        inv, factor = ours(CASES[name])
        cache = rope_cos_sin_cache(inv, factor, 300)  # (L, 2, D/2)
        half = HEAD_DIM // 2
        assert torch.allclose(cache[:, 0], cos[0, :, :half], atol=1e-6, rtol=0), name
        assert torch.allclose(cache[:, 1], sin[0, :, :half], atol=1e-6, rtol=0), name
        assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # HF duplicates the halves


@pytest.mark.parametrize("name", ["default", "llama3", "yarn_mscale"])
def test_apply_rope_matches_hf_bit_exactly(name):
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 37, 8, 2, HEAD_DIM
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    positions = torch.randint(0, 4000, (T,), generator=g)
    cfg = hf_config(CASES[name])
    cos_full, sin_full = LlamaRotaryEmbedding(cfg)(q, positions[None, :])  # (1, T, D)
    # HF layout: (batch, heads, seq, dim)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full, sin_full)
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)  # (T, H, D)
    half = D // 2
    cos = cos_full[0, :, None, :half]  # (T, 1, D/2)
    sin = sin_full[0, :, None, :half]
    assert torch.equal(apply_rope(q, cos, sin), q_ref)
    assert torch.equal(apply_rope(k, cos, sin), k_ref)
    # a strided view (q and k side by side in one qkv row, as the model passes them)
    qk = torch.cat([q, k], dim=1)  # (T, Hq+Hkv, D)
    qkv = torch.cat([qk.reshape(T, -1), torch.randn(T, Hkv * D, generator=g)], dim=1)
    view = qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D)
    out = apply_rope(view, cos, sin)
    assert torch.equal(out[:, :Hq], q_ref) and torch.equal(out[:, Hq:], k_ref)


def test_apply_rope_with_our_cache_matches_hf_closely():
    """End to end: our cos/sin cache indexed by position, against HF's rotary embedding."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 50, 4, HEAD_DIM
    x = torch.randn(T, H, D, generator=g)
    positions = torch.randint(0, 2000, (T,), generator=g)
    scaling = CASES["llama3"]
    cs = rope_cos_sin_cache(*ours(scaling), 2048)[positions]  # (T, 2, D/2)
    got = apply_rope(x, cs[:, 0:1], cs[:, 1:2])
    cos, sin = LlamaRotaryEmbedding(hf_config(scaling))(x, positions[None, :])
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert torch.allclose(got, ref[0].transpose(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su", "nonsense"])
def test_unsupported_rope_type_raises_value_error(kind):
    with pytest.raises(ValueError, match="not supported"):
        rope_inv_freq(HEAD_DIM, THETA, {"rope_type": kind, "factor": 2.0})
