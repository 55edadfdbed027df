"""Checkpoint names for a trainer's tensors.

transformers (5.x) keeps a mixture-of-experts layer's experts fused in memory
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I), Mixtral's router as
`mlp.gate`) and writes one tensor per expert to checkpoints (Qwen3-MoE: `mlp.experts.E.gate_proj /
up_proj / down_proj`; Mixtral: `block_sparse_moe.experts.E.w1 / w3 / w2`). The engine takes
either in a push, and its weights_checksum names tensors the checkpoint's way (its experts may
live on different replicas); `checkpoint_named` gives a trainer the same names for its own
checksum. Dense tensors pass through unchanged.
"""
from collections.abc import Iterable, Iterator

import torch


def router_name(layer: str, model_type: str) -> str:
    """The checkpoint name of the router of the layer whose names start with `layer` ("model.layers.3.")."""
    return f"{layer}{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}.gate.weight"


def expert_names(layer: str, expert: int, model_type: str) -> tuple[str, str, str]:
    """The checkpoint names of one expert's (gate, up, down) projections in that layer."""
    if model_type == "mixtral":
        p = f"{layer}block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"{layer}mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def split_experts(name: str, t: torch.Tensor, model_type: str, first: int = 0,
                  num_experts: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused `...mlp.experts.gate_up_proj` or `down_proj` tensor as checkpoint-named views.
    `t` may hold experts [first, first + len(t)) of num_experts (an expert-parallel replica's);
    the others' names then come with empty tensors."""
    layer, gate_up = name.rsplit("mlp.experts.", 1)[0], name.endswith("gate_up_proj")
    i = t.shape[1] // 2
    for e in range(len(t) if num_experts is None else num_experts):
        gate, up, down = expert_names(layer, e, model_type)
        if first <= e < first + len(t):
            w = t[e - first]
            yield from ((gate, w[:i]), (up, w[i:])) if gate_up else ((down, w),)
        else:
            empty = t.new_empty(0, t.shape[-1])
            yield from ((gate, empty), (up, empty)) if gate_up else ((down, empty),)


def checkpoint_named(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with fused expert tensors split per expert (views, no copy);
    model_type: the transformers config's ("qwen3_moe", "mixtral", or any dense one)."""
    for name, t in named_tensors:
        if model_type == "mixtral" and name.endswith(".mlp.gate.weight"):
            yield router_name(name.rsplit("mlp.", 1)[0], model_type), t
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from split_experts(name, t, model_type)
        else:
            yield name, t
