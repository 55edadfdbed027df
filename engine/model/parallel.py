"""Tensor parallelism: how a model's tensors split between the T ranks of one replica, and the
collectives the forward pass needs from them.

Megatron's split, as vLLM and SGLang do it: q/k/v and gate/up are column-parallel (each rank
holds some heads and some intermediate columns, rows of the fused tensors), o and down are
row-parallel (each rank multiplies its slice of the input and the partial outputs are summed by
one all-reduce), the embedding and the LM head are split by vocabulary rows (the embedding's
partial rows are summed, the LM head's logits gathered to rank 0, which samples). Norms, rotary
tables and a classifier's small head are replicated. Each rank's KV cache holds its kv heads.

Splits need not be even: ranks take contiguous ranges, the first ones one more (SmolLM2-135M has
9 query heads in 3 groups: TP=2 gives rank 0 two kv heads with six query heads, rank 1 one with
three). Heads split by kv group so that a query head and its kv head stay on one rank; with
more ranks than kv heads each rank holds one kv head (replicated, as in vLLM) and a part of its
group's query heads, which needs T to be a multiple of the kv head count.

Every rank computes the same replicated activations bit for bit: the all-reduce sums in one
fixed order on every rank (engine/worker/tp_group.py), so no rank's residual stream drifts from
another's.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import UnsupportedModelError


class TPGroup(Protocol):
    """The collectives between the ranks of one replica (engine/worker/tp_group.py builds them)."""

    rank: int
    size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks, the same bits on every rank; returns t."""

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (the same shape and dtype on every rank) on rank 0, in rank order; None elsewhere."""


def gather_along(tp: TPGroup, t: torch.Tensor, dim: int, counts: list[int]) -> list[torch.Tensor] | None:
    """gather() of slices whose size along `dim` differs between ranks (rank r's is counts[r]):
    padded to the largest for the transport, cut back on rank 0."""
    width = max(counts)
    if t.shape[dim] < width:
        pad = list(t.shape)
        pad[dim] = width - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    parts = tp.gather(t.contiguous())
    return None if parts is None else [p.narrow(dim, 0, n) for p, n in zip(parts, counts)]


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank's contiguous share of n items; the first n % size ranks take one more."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Partition:
    """One rank's share of a model: heads, intermediate columns, vocabulary rows."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # (first, count)
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, intermediate: int, vocab: int, size: int,
           rank: int) -> "Partition":
        q, kv = head_split(num_heads, num_kv_heads, size, rank)
        return cls(rank, size, q, kv, split(intermediate, size, rank), split(vocab, size, rank))

    @property
    def sharded(self) -> bool:
        return self.size > 1


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((first q head, count), (first kv head, count)) of `rank` (see the module docstring)."""
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv0, nkv = split(num_kv_heads, size, rank)
        return (kv0 * group, nkv * group), (kv0, nkv)
    if size % num_kv_heads:
        raise UnsupportedModelError(f"tensor_parallel_size {size} is more than the model's {num_kv_heads} kv heads "
                                    f"and not a multiple of it")
    per_head = size // num_kv_heads  # ranks sharing one kv head
    if per_head > group:
        raise UnsupportedModelError(f"tensor_parallel_size {size} is more than the model's {num_heads} attention heads")
    kv = rank // per_head
    q0, nq = split(group, per_head, rank % per_head)
    return (kv * group + q0, nq), (kv, 1)


@dataclass(frozen=True)
class Shard:
    """Which slice of a full Hugging Face tensor a rank holds: `dim` (None: the whole tensor,
    replicated) and each rank's (start, count) along it."""

    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    size: int | None = None  # the full size along dim when no range reaches it (an expert-parallel replica's)

    def of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """rank's slice of a full tensor (a view)."""
        if self.dim is None:
            return full
        start, count = self.ranges[rank]
        return full.narrow(self.dim, start, count)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(local_shape)
        shape = list(local_shape)
        shape[self.dim] = self.size if self.size is not None else max(s + n for s, n in self.ranges)
        return tuple(shape)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order (ranks that replicate one kv
        head hold the same slice: placed twice, the same bits)."""
        if self.dim is None:
            return parts[0]
        full = parts[0].new_empty(self.full_shape(tuple(parts[0].shape)))
        for part, (start, count) in zip(parts, self.ranges):
            full.narrow(self.dim, start, count).copy_(part)
        return full
