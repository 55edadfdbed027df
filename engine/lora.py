"""LoRA adapters from PEFT folders: loading and checking (`load_adapter`), and applying the adapters
of a batch's requests to the fused projections of engine.model (`LoRABatch`).

    LoRARequest(lora_name, lora_int_id, lora_path)     vLLM's fields; id 0 is the base model

A PEFT LoRA folder holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...) and
adapter_model.safetensors with `base_model.model.<HF module>.lora_A.weight` (r, in) and `lora_B.weight`
(out, r) per target module. The engine fuses q/k/v and gate/up into one matmul each, so an adapter
is kept as, per decoder layer and fused projection ("qkv", "o", "gate_up", "down"), a list of
Delta(first output row, A, B): the delta of output rows [row, row + B.rows) is
scale * (x @ A.T) @ B.T, computed in that order as PEFT does (lora_B(lora_A(x)) * scaling).

Refused with an InvalidRequestError naming the problem (nothing is loaded): a missing folder or
file, weights that are not safetensors, another PEFT method or DoRA, biases, rank above
max_lora_rank, per-module rank or alpha patterns, modules the engine has no place for (embeddings,
lm_head, modules_to_save), a layer the model does not have, a wrong shape.
"""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str


# HF module -> (fused projection of engine.model, index of its slice: q, k, v / gate, up)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class Delta:
    row: int  # first output row of the fused projection this module writes
    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))


@dataclass
class Adapter:
    request: LoRARequest
    rank: int
    deltas: list[dict[str, list[Delta]]]  # per layer: fused projection -> its deltas

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.deltas for ds in layer.values()
                   for d in ds for t in (d.A, d.B))


def module_shapes(mc: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """HF module -> (first output row in its fused projection, out_features, in_features)."""
    H, inter = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {"q_proj": (0, q, H), "k_proj": (q, kv, H), "v_proj": (q + kv, kv, H), "o_proj": (0, H, q),
            "gate_proj": (0, inter, H), "up_proj": (inter, inter, H), "down_proj": (0, H, inter)}


def load_adapter(request: LoRARequest, mc: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> Adapter:
    def bad(problem: str) -> InvalidRequestError:
        return InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {problem}", "lora_path")

    folder = Path(request.lora_path)
    if not (folder / "adapter_config.json").is_file():
        raise bad("no adapter_config.json (not a PEFT adapter folder)")
    if not (folder / "adapter_model.safetensors").is_file():
        raise bad("no adapter_model.safetensors (only safetensors adapters load)")
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise bad(f"adapter_config.json is not JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora"):
        raise bad(f"only plain LoRA adapters load (peft_type {cfg.get('peft_type')!r}, use_dora {cfg.get('use_dora')})")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias") or cfg.get("modules_to_save"):
        raise bad("adapters with biases or modules_to_save are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise bad("per-module rank_pattern / alpha_pattern are not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise bad(f"r must be a positive int and lora_alpha a number (r={rank!r}, lora_alpha={alpha!r})")
    if rank > max_rank:
        raise bad(f"rank {rank} is above max_lora_rank {max_rank}")
    targets = cfg.get("target_modules") or []
    targets = list(MODULES) if targets == "all-linear" else targets
    # (PEFT saves "all-linear" as full module paths: model.layers.0.self_attn.q_proj, ...)
    if isinstance(targets, str) or not {t.split(".")[-1] for t in targets} <= set(MODULES):
        raise bad(f"target_modules {targets!r}: the engine applies LoRA to {', '.join(MODULES)} only")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except Exception as e:  # a truncated or corrupt file
        raise bad(f"adapter_model.safetensors cannot be read ({e})") from e
    shapes = module_shapes(mc)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            raise bad(f"unexpected tensor {key!r} (the engine has no place for it)")
        layer = int(m.group(1))
        if layer >= mc.num_layers:
            raise bad(f"{key}: the model has {mc.num_layers} layers")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    deltas: list[dict[str, list[Delta]]] = [{} for _ in range(mc.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        row, out_f, in_f = shapes[module]
        A, B = ab.get("A"), ab.get("B")
        if A is None or B is None:
            raise bad(f"layer {layer} {module}: lora_A and lora_B must both be present")
        if tuple(A.shape) != (rank, in_f) or tuple(B.shape) != (out_f, rank):
            raise bad(f"layer {layer} {module}: lora_A {list(A.shape)} / lora_B {list(B.shape)}, expected "
                      f"{[rank, in_f]} / {[out_f, rank]}")
        fused = MODULES[module][0]
        deltas[layer].setdefault(fused, []).append(
            Delta(row, A.to(device, dtype).contiguous(), B.to(device, dtype).contiguous(), scale))
    if not pairs:
        raise bad("adapter_model.safetensors holds no LoRA weights")
    return Adapter(request, rank, deltas)


class LoRABatch:
    """The adapters of one step's tokens: `apply(layer, name, x, y)` adds each token's adapter
    delta to y = projection(x), in place. Tokens of the base model (no adapter) are left alone.
    groups: (adapter, row indices of its tokens), one per adapter present in the step."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[Adapter, torch.Tensor]]):
        self.groups = groups

    def apply(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        for adapter, rows in self.groups:
            ds = adapter.deltas[layer].get(name)
            if not ds:
                continue
            xs = x.index_select(0, rows)
            for d in ds:
                delta = (xs @ d.A.T) @ d.B.T * d.scale
                y[rows, d.row:d.row + d.B.shape[0]] += delta
