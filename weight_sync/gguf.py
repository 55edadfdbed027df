"""GGUF -> safetensors conversion: turns a (quantized) GGUF file into a plain Hugging Face
folder (config.json, model.safetensors in float32, tokenizer files) that every weight route
reads. Used once for the embedded default model (engine/default_model.py); needs `gguf` and
`accelerate`, at conversion time only.

Trap: `save_pretrained` refuses a model loaded from GGUF ("not serializable"), so the tensors are
written with safetensors directly and the config through a clean config object of its own.
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path


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
