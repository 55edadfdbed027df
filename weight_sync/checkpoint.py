"""Weights in a safetensors checkpoint on disk: the push route that needs no process group, and
the engine's save_weights.

A folder holds `model.safetensors`, or shards plus `model.safetensors.index.json` (Hugging Face
layout; the index's `weight_map` names the shards, and a shard it names must exist). Tensors are
yielded one at a time from memory-mapped files, on the CPU, with their stored dtype; written
(`save_safetensors_folder`) one shard at a time in that same layout.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint files of a folder (or a single `.safetensors` file), in a stable order."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no safetensors checkpoint at {path}: not a folder or a .safetensors file")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_safetensors_folder(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard; a name found twice is an error."""
    seen: set[str] = set()
    for file in safetensors_files(path):
        try:
            f = safe_open(file, framework="pt", device="cpu")
        except Exception as e:  # safetensors' own error type: a truncated or corrupt file
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from e
        with f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one shard of {path}")
                seen.add(name)
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"tensor {name!r} of {file} cannot be read: {e}") from e
                yield name, tensor


def save_safetensors_folder(named_tensors: Iterable[tuple[str, torch.Tensor]], folder: str | Path, *,
                            max_shard_bytes: int) -> dict:
    """Write (name, tensor) pairs into an empty folder in the Hugging Face layout: one
    `model.safetensors`, or when they pass `max_shard_bytes`, `model-00001-of-0000N.safetensors`...
    and the index (`metadata.total_size`, `weight_map`), as huggingface_hub's
    split_torch_state_dict_into_shards lays them out: filled in order, a new file when the next
    tensor would pass the limit, a tensor larger than the limit alone in its file. Tensors keep
    their dtype; one shard at a time is copied to the CPU. On failure the folder holds partial
    files: write into a folder of your own and discard it. Returns {"files", "bytes", "tensors"}."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")
    folder = Path(folder)
    parts: list[list[str]] = []  # the tensor names of each file written so far
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes
        save_file(shard, folder / f"part-{len(parts)}.safetensors", metadata={"format": "pt"})
        parts.append(list(shard))
        shard, shard_bytes = {}, 0

    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        size = t.numel() * t.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = t.detach().to("cpu", copy=True).contiguous()  # (its own storage: views of fused tensors)
        shard_bytes += size
        total_bytes += size
    if shard:
        flush()
    if not parts:
        raise ValueError("no tensors to save")
    names = ["model.safetensors"] if len(parts) == 1 else \
        [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for i, name in enumerate(names):
        os.rename(folder / f"part-{i}.safetensors", folder / name)
    if len(parts) > 1:
        weight_map = {t: name for name, part in zip(names, parts) for t in part}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX_NAME)
    return {"files": names, "bytes": total_bytes, "tensors": sum(len(p) for p in parts)}
