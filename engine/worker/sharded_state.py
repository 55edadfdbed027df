"""Each tensor-parallel rank's own slices on disk, and back (vLLM's save_sharded_state and its
`load_format="sharded_state"`): a replica of T ranks restarts by reading only its shards, with no
full tensor read or cut.

    folder/
        model-rank-{rank}-part-{part}.safetensors   rank's slices by Hugging Face name (the
                                                     pattern is a parameter), at most max_size
                                                     bytes a file when given
        sharded_state.json                           {"tensor_parallel_size", "dtype", "pattern"}
        config.json, tokenizer files                 copied from the model folder (rank 0), so
                                                     the folder is a model folder of its own

Loading it takes the same tensor_parallel_size (a slice's rows depend on it) and refuses a folder
written by another, or a rank's file set that lacks a tensor.
"""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.errors import InvalidRequestError, UnsupportedModelError

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
METADATA = "sharded_state.json"


def save_rank(folder: str, rank: int, size: int, dtype: str, named: list[tuple[str, torch.Tensor]],
              pattern: str | None, max_size: int | None) -> dict:
    """Write one rank's slices; rank 0 writes the metadata too. Returns {"files", "bytes"}."""
    pattern = pattern or DEFAULT_PATTERN
    if "{rank}" not in pattern or "{part}" not in pattern:
        raise InvalidRequestError(f"pattern {pattern!r} must contain {{rank}} and {{part}}", "pattern")
    if max_size is not None and max_size < 1:
        raise InvalidRequestError(f"max_size must be at least 1 byte, got {max_size}", "max_size")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    files, part, total = [], {}, 0
    size_now = 0

    def flush():
        nonlocal part, size_now
        name = pattern.format(rank=rank, part=len(files))
        save_file({k: v.contiguous() for k, v in part.items()}, str(path / name), metadata={"format": "pt"})
        files.append(name)
        part, size_now = {}, 0

    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if part and max_size is not None and size_now + nbytes > max_size:
            flush()
        part[name] = t
        size_now += nbytes
        total += nbytes
    if part or not files:
        flush()
    if rank == 0:
        (path / METADATA).write_text(json.dumps({"tensor_parallel_size": size, "dtype": dtype, "pattern": pattern}))
    return {"files": files, "bytes": total}


def is_sharded_state(folder: str) -> bool:
    return (Path(folder) / METADATA).is_file()


def read_rank(folder: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank's slices from a folder save_rank wrote (UnsupportedModelError if it cannot serve them)."""
    path = Path(folder)
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"{folder}: no readable {METADATA} (not a sharded_state folder): {e}") from e
    if meta.get("tensor_parallel_size") != size:
        raise UnsupportedModelError(f"{folder} holds the shards of tensor_parallel_size "
                                    f"{meta.get('tensor_parallel_size')}, this engine runs {size}")
    pattern = meta.get("pattern", DEFAULT_PATTERN)
    tensors: dict[str, torch.Tensor] = {}
    part = 0
    while (path / pattern.format(rank=rank, part=part)).is_file():
        tensors.update(load_file(str(path / pattern.format(rank=rank, part=part))))
        part += 1
    if not part:
        raise UnsupportedModelError(f"{folder}: no file {pattern.format(rank=rank, part=0)} for rank {rank}")
    return tensors
