"""The live weights as a Hugging Face folder (Worker.save_weights): what
`transformers.AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`
load, the weights a trainer pushed included.

    folder/
        model.safetensors, or model-0000i-of-0000N.safetensors + model.safetensors.index.json
                              tensors by Hugging Face names, in the served dtype
        config.json           the model folder's, torch_dtype set to the served dtype
        generation_config.json, tokenizer files, chat template, ...
                              copied from the model folder (and the tokenizer folder if another)

The folder is written beside its target under a hidden name and renamed into place at the end:
a failure leaves no half folder (and with `overwrite`, the old folder whole). The engine's own
model folder is never a target: reload_weights reads it.
"""
import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.worker.sharded_state import METADATA as SHARDED_STATE_METADATA
from weight_sync.checkpoint import save_safetensors_folder

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # huggingface_hub's MAX_SHARD_SIZE ("5GB")
# the model folder's files that are weights (written anew here) rather than configuration
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".index.json")


def check_target(folder: str, overwrite: bool, sources: list[str | None]) -> Path:
    """The absolute target, or InvalidRequestError (before anything is read or written) when it
    exists and is not an empty folder (unless `overwrite`), or holds one of `sources` (the
    engine's model and tokenizer folders)."""
    if not folder:
        raise InvalidRequestError("the folder to save into is empty")
    target = Path(os.path.abspath(os.path.expanduser(folder)))
    for source in filter(None, sources):
        src = Path(source).resolve()
        if target.resolve() in (src, *src.parents):
            raise InvalidRequestError(f"{str(target)!r} holds the engine's own model or tokenizer folder "
                                      f"({source}): save elsewhere")
    if target.exists() and not target.is_dir():
        raise InvalidRequestError(f"{str(target)!r} exists and is not a folder")
    if target.is_dir() and not overwrite and any(target.iterdir()):
        raise InvalidRequestError(f"the folder {str(target)!r} exists and is not empty: pass overwrite=True to "
                                  "replace it")
    return target


def save_hf_folder(target: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], model_folder: str,
                   tokenizer_folder: str | None, dtype: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Write the folder at `target` (from check_target); returns {"path", "files" (the
    checkpoint's), "bytes", "tensors"}. InvalidRequestError when it cannot be created."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:8]}"
        staging.mkdir()  # (the umask's permissions, as save_pretrained's folders get)
    except OSError as e:
        raise InvalidRequestError(f"cannot write the folder {str(target)!r}: {e}") from None
    try:
        written = save_safetensors_folder(named_tensors, staging, max_shard_bytes=max_shard_bytes)
        write_side_files(staging, model_folder, tokenizer_folder, dtype)
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dict(written, path=str(target))


def write_side_files(folder: Path, model_folder: str, tokenizer_folder: str | None, dtype: str) -> None:
    """config.json (in `dtype`), generation config, tokenizer and the like: what makes a folder of
    weights a model folder."""
    for source in dict.fromkeys(f for f in (model_folder, tokenizer_folder) if f and Path(f).is_dir()):
        _copy_side_files(Path(source), folder)
    _write_config(Path(model_folder), folder, dtype)


def _copy_side_files(source: Path, staging: Path) -> None:
    """Every top-level file of the model folder but its weights, config.json and hidden files."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in ("config.json", SHARDED_STATE_METADATA) and not f.name.startswith(".") \
                and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(f, staging / f.name)


def _write_config(model_folder: Path, staging: Path, dtype: str) -> None:
    config = json.loads((model_folder / "config.json").read_text())
    config["torch_dtype"] = dtype
    if "dtype" in config:  # (transformers >= 5 writes this name)
        config["dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder to the target; an existing one is set aside first and removed
    after, so the target is never half written."""
    if not target.exists():
        os.rename(staging, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
