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


def checkpoint_named(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with fused expert tensors split per expert (views, no copy);
    model_type: the transformers config's ("qwen3_moe", "mixtral", or any dense one)."""
    mixtral = model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, t in named_tensors:
        if mixtral and name.endswith(".mlp.gate.weight"):
            yield name.replace(".mlp.", ".block_sparse_moe."), t
            continue
        if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield name, t
            continue
        prefix = name.rsplit("mlp.experts.", 1)[0] + ("block_sparse_moe.experts." if mixtral else "mlp.experts.")
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                i = t.shape[1] // 2
                yield f"{prefix}{e}.{gate}.weight", t[e, :i]
                yield f"{prefix}{e}.{up}.weight", t[e, i:]
            else:
                yield f"{prefix}{e}.{down}.weight", t[e]
