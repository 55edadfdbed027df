"""Weights from a safetensors checkpoint on disk: the push route that needs no process group.

A folder holds `model.safetensors`, or shards plus `model.safetensors.index.json` (Hugging Face
layout; the index's `weight_map` names the shards, and a shard it names must exist). Tensors are
yielded one at a time from memory-mapped files, on the CPU, with their stored dtype.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

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
