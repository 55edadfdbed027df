"""A deterministic digest of named tensors, so a trainer can verify a push bit for bit.

    digest = sha256( for name in sorted(names):  name NUL dtype NUL shape NUL sha256(raw bytes) )

Raw bytes means the tensor's own bit pattern, little-endian, in row-major (contiguous) order: a
bf16 tensor hashes its 2-byte values (viewed as uint8; numpy has no bf16), -0.0 differs from 0.0,
NaN payloads count. Pass `dtype` on both sides to compare a trainer's fp32 master weights with an
engine serving bf16: floating-point tensors are cast first (others are left alone, as in
`Module.to(dtype)` and `WeightSender.send(dtype=...)`).

The per-tensor hashes (sha256: hardware-accelerated on current x86 and ARM, ~1.1 GB/s per core
here, a bit faster than blake2b) run on a few threads, as hashlib releases the GIL: SmolLM2-135M
takes ~0.2-0.4 s in bf16, ~0.5-0.7 s in fp32 on this shared 2-core box (benchmarks/weight_transfer.py).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _tensor_digest(t: torch.Tensor, dtype: torch.dtype) -> bytes:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.to(dtype).contiguous()  # no-ops when already so; a cast copy lives only while hashed
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).digest()  # raw bytes, bf16 too


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """Hex digest over (name, dtype, shape, raw bytes) of every tensor, in sorted name order."""
    return combine_digests(tensor_entries(named_tensors, dtype))


def tensor_entries(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   dtype: torch.dtype | None = None) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """{name: (dtype, shape, sha256 hex of the raw bytes)}: what weights_checksum combines, so that
    parts of a model held in different places (expert-parallel replicas) combine into its number."""
    items: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        if name in items:
            raise ValueError(f"duplicate tensor name {name!r}")
        items[name] = t
    names = sorted(items)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda n: _tensor_digest(items[n], _out_dtype(items[n], dtype)), names))
    return {name: (str(_out_dtype(items[name], dtype)).removeprefix("torch."), tuple(items[name].shape), digest.hex())
            for name, digest in zip(names, digests)}


def combine_digests(entries: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    top = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, digest = entries[name]
        top.update(f"{name}\0{dtype}\0{tuple(shape)}\0".encode())
        top.update(bytes.fromhex(digest))
    return top.hexdigest()


def tensor_digests(model) -> dict[str, str]:
    """{Hugging Face name: sha256 hex of its raw bytes in the served dtype} of one worker's
    weights (a tensor-parallel rank's slices as it holds them): vLLM's /weight_checker values.
    `model` is an engine model (anything with hf_views()); it runs on the worker, by import
    path, through AsyncLLM.apply_model."""
    out = {}
    for name, view in model.hf_views():
        t = view.detach().cpu().contiguous()
        out[name] = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return out
