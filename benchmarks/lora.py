"""LoRA decode overhead: batch-32 greedy decode of the default model with no adapter, one adapter
for every request, and four adapters (8 requests each), beside PEFT on transformers (one adapter,
batch 32: PEFT runs one active adapter per forward), measured in one run.

Adapters: rank 16 on all seven projections (q, k, v, o, gate, up, down), random A and B, written
as PEFT folders (adapter_config.json + adapter_model.safetensors) into a temporary folder.
Workload: the shared peer workload's 32 chat prompts, 64 new tokens each, EOS ignored.

    python benchmarks/lora.py                       # float32 (~5 min on 2 cores)
    python benchmarks/lora.py --dtype bfloat16 --new-tokens 32
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from throughput import workload  # noqa: E402
from timing import machine_line  # noqa: E402

RANK = 16


def write_adapter(folder: Path, mc, seed: int) -> str:
    from engine.worker.lora import module_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for module, (_, out_f, in_f) in module_shapes(mc).items():
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g) * in_f ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(module_shapes(mc)),
         "bias": "none", "task_type": "CAUSAL_LM"}))
    return str(folder)


def ours(prompts, new_tokens, dtype, adapters) -> dict:
    from engine import LLM, SamplingParams
    from engine.worker.lora import LoRARequest

    llm = LLM(dtype=dtype, enable_lora=True, max_loras=4, max_lora_rank=RANK, enable_prefix_caching=False,
              multiprocess=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    cases = {"no adapter": [None] * len(prompts), "1 adapter": [loras[0]] * len(prompts),
             "4 adapters": [loras[i % 4] for i in range(len(prompts))]}
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=loras)  # load, warm up
    out = {}
    for name, lora_of in cases.items():
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora_of)
            best = min(best, time.perf_counter() - t0)
        out[name] = len(prompts) * new_tokens / best
        print(f"[bench] ours, {name}: {out[name]:.0f} tok/s", file=sys.stderr, flush=True)
    llm.shutdown()
    return out


def peft_peer(prompts, new_tokens, dtype, adapter) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=tok.pad_token_id)
    out = {}
    for name, model in (("no adapter", base), ("1 adapter", None)):
        if model is None:
            model = PeftModel.from_pretrained(base, adapter).eval()
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**enc, generation_config=cfg)
            best = min(best, time.perf_counter() - t0)
        out[name] = len(prompts) * new_tokens / best
        print(f"[bench] PEFT, {name}: {out[name]:.0f} tok/s", file=sys.stderr, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from engine.config import ModelConfig
    from engine.default_model import resolve_model

    path = resolve_model(None)
    mc = ModelConfig.from_folder(path)
    w = workload()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = w.prompt_texts(tok, w.QUESTIONS[:32])
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [write_adapter(Path(tmp) / f"a{i}", mc, seed=i) for i in range(4)]
        ours_res = ours(prompts, args.new_tokens, args.dtype, adapters)
        peer = peft_peer(prompts, args.new_tokens, args.dtype, adapters[0])
    print(machine_line())
    print(f"LoRA decode, batch 32, {args.new_tokens} new tokens, rank {RANK} on all 7 projections, "
          f"{args.dtype} (tok/s)")
    print("| case | ours | PEFT on transformers | ours vs PEFT |")
    print("|---|---|---|---|")
    for case in ("no adapter", "1 adapter", "4 adapters"):
        p = peer.get(case)
        print(f"| {case} | {ours_res[case]:.0f} ({ours_res[case] / ours_res['no adapter']:.2f}x of no adapter) | "
              f"{'-' if p is None else f'{p:.0f}'} | {'-' if p is None else f'{ours_res[case] / p:.2f}x'} |")


if __name__ == "__main__":
    main()
