"""Random-weight Llama checkpoints for the benchmarks: a transformers LlamaConfig preset, weights
from transformers' own init (normal, std 0.02; norms 1), saved as safetensors beside a tokenizer,
so that our engine and transformers both load the folder offline (benchmarks/throughput.py --model).
Throughput does not depend on the weights' values; it lets a machine without the real checkpoint
(a GPU box with no network) measure a model of the shape it needs.

Presets: smollm2-135m is the default model's architecture (SmolLM2-135M-Instruct's config.json);
1b is a Llama-3.2-1B-like shape with SmolLM2's 49152-token vocabulary (about 1.07B parameters).

Tokenizer: the files of --tokenizer FOLDER, by default the converted default model's folder (our
LLM always loads a tokenizer). A machine without the default model takes its tokenizer files
copied into any folder (benchmarks/gpu_check.sh carries them to a GPU machine).

    python benchmarks/random_llama.py --preset smollm2-135m --out /tmp/smollm2-random
    python benchmarks/random_llama.py --preset 1b --out /tmp/llama-1b            # ~2.1 GB in bfloat16
    python benchmarks/random_llama.py --preset 1b --dry-run                      # the count, no weights
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing here downloads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# both presets use SmolLM2's vocabulary and its special tokens' ids
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu", initializer_range=0.02,
              attention_bias=False, mlp_bias=False, tie_word_embeddings=True, vocab_size=49152)
PRESETS = {
    # ~/.cache/rollout/models/SmolLM2-135M-Instruct/config.json (its rms_norm_eps reads 9.9999997e-06:
    # 1e-5 through float32 in the GGUF conversion)
    "smollm2-135m": dict(COMMON, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "1b": dict(COMMON, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=4096),
}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]


def num_params(cfg: dict) -> int:
    """Parameters of the preset's model, from the config alone (a tied embedding counted once)."""
    H, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * inter + 2 * H  # q/k/v, o, gate/up/down, two norms
    return V * H * (1 if cfg["tie_word_embeddings"] else 2) + L * per_layer + H


def build(cfg: dict, dtype: str, seed: int, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    # on the GPU where there is one: a 1B model's init takes minutes on a few CPU cores
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)  # seeds the CUDA generators too (a CPU and a GPU build still differ)
    t = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert n == num_params(cfg), (n, num_params(cfg))
    log(f"initialized {n / 1e9:.3f}B parameters on {device} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    model.save_pretrained(out)  # safetensors, config.json (architectures, dtype), generation_config.json
    log(f"saved to {out} in {time.perf_counter() - t:.1f} s")


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main():
    from engine.default_model import converted_default_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", help="the folder to write (created; required unless --dry-run)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path, default=converted_default_model(),
                    help="copy the tokenizer from this folder (default: the default model's converted folder)")
    ap.add_argument("--dry-run", action="store_true", help="print the config and its parameter count only")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    if not args.dry_run and not (args.tokenizer / "tokenizer.json").is_file():
        ap.error(f"no tokenizer.json in {args.tokenizer}: our LLM and the benchmarks' prompts need the default "
                 "model's tokenizer (copy its tokenizer files into a folder and name it with --tokenizer)")
    n = num_params(cfg)
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    log(f"preset {args.preset}: {n / 1e9:.3f}B parameters, {n * itemsize / 1e9:.2f} GB in {args.dtype}")
    if args.dry_run:
        print(json.dumps(cfg, indent=1))
        return
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    build(cfg, args.dtype, args.seed, out)
    copy_tokenizer(args.tokenizer, out)
    log(f"tokenizer copied from {args.tokenizer}")
    print(out)


if __name__ == "__main__":
    main()
