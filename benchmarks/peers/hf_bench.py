"""transformers `generate()` on the throughput workload, run inside the peer venv made by
`python benchmarks/peers.py setup hf` (torch CPU + transformers; nothing of this repository).

    $PEERS_DIR/venv-hf/bin/python benchmarks/peers/hf_bench.py --model DIR --dtype bfloat16

A batch is one left-padded `generate()` call. Trap: generate() refills eos_token_id from
model.generation_config, so ignoring EOS needs it cleared there too (and min_new_tokens).
Prints one JSON line (workload.measure's keys plus engine, version, dtype) on stdout.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import measure  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face folder (safetensors)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(os.cpu_count())
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - t
    model.generation_config.eos_token_id = None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def run(prompts, sample, n):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id)
        kw.update(dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if sample else dict(do_sample=False))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=GenerationConfig(**kw))
        return time.perf_counter() - t0, out[:, enc["input_ids"].shape[1]:].tolist()

    res = measure(tok, run, [int(b) for b in args.batches.split(",")], args.reps, load_s)
    res.update(engine="transformers", version=transformers.__version__, torch=torch.__version__, dtype=args.dtype)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
