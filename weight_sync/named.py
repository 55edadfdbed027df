"""The weight wire of SGLang's `update_weights_from_distributed` (slime's and AReaL's trainers
speak it): the names, dtypes and shapes travel in the HTTP call, and rank 0 then broadcasts each
tensor in that order, or, with load_format "flattened_bucket", all of them as one uint8 buffer
(each tensor's bytes, flattened, back to back). The group is a named torch.distributed group
(WeightTransferGroup(group_name=...)). There is no handshake in this wire: a receiver takes
every byte even when it will refuse the push, so the trainer's broadcasts always complete.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from weight_sync.group import WeightTransferGroup
from weight_sync.protocol import parse_dtype

FLATTENED = "flattened_bucket"


def named_metas(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) per tensor; ValueError naming the first bad entry (before any byte
    is received: the sizes must be known to receive at all)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} "
                         f"and {len(shapes)}")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        parsed = parse_dtype(str(dtype).removeprefix("torch."))
        if parsed is None:
            raise ValueError(f"{name}: unknown dtype {dtype!r} (spell it as torch does, e.g. 'bfloat16')")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"{name}: shape {shape} is not a list of non-negative integers")
        metas.append((name, parsed, tuple(shape)))
    return metas


def receive_named(group: WeightTransferGroup, metas: list[tuple[str, torch.dtype, tuple]], flattened: bool = False,
                  keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one push, in `metas` order; `keep(name, tensor)`: the part to keep (a
    tensor-parallel rank's slice), taken as each arrives."""
    out = {}
    if flattened:
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in metas]
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
        if buf.numel():
            group.broadcast(buf)
        offset = 0
        for (name, dtype, shape), size in zip(metas, sizes):
            out[name] = buf[offset:offset + size].view(dtype).view(shape)
            offset += size
    else:
        for name, dtype, shape in metas:
            t = torch.empty(shape, dtype=dtype, device=group.device)
            group.broadcast(t)
            out[name] = t
    if keep is not None:
        out = {name: keep(name, t) for name, t in out.items()}
    return out


def send_named(group: WeightTransferGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
               flattened: bool = False) -> None:
    """The trainer's side (rank 0), for tests and for trainers of our own: broadcast the tensors
    in the order their metadata was sent."""
    tensors = [t.detach().to(group.device).contiguous() for _, t in named_tensors]
    if flattened:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else None
        if flat is not None and flat.numel():
            group.broadcast(flat)
        return
    for t in tensors:
        group.broadcast(t)
