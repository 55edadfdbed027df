"""Deterministically perturbed weights of a checkpoint (what a trainer step would produce)."""
import torch

from weight_sync import load_safetensors_folder


def perturbed_state(path: str, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every tensor t -> t + scale * std(t) * noise, float32, HF names (no lm_head when tied)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(load_safetensors_folder(path)):
        t = t.float()
        noise = torch.randn(t.shape, generator=g)
        out[name] = t + scale * (t.std() if t.numel() > 1 else 1.0) * noise
    return out


def hf_model_with(path: str, state: dict[str, torch.Tensor]):
    from tests.engine.hf_reference import load_hf

    model = load_hf(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model

