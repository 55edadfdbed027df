"""Tensor parallelism on one machine's cores, in one run: the same cores as one replica of two
threads, one replica of two single-thread ranks (shared-memory all-reduce, and gloo beside it),
or two single-thread replicas.

    tp1x2   LLM(num_threads=2)                                one rank, two threads
    tp2x1   LLM(tensor_parallel_size=2)                       two ranks, one thread each (shm)
    tp2x1g  the same over gloo (tensor_parallel_transport="gloo")
    dp2x1   LLM(data_parallel_size=2)                         two replicas, one thread each

Workload: benchmarks/peers/workload.py's 32 chat prompts (repeated to the batch), 128 new tokens,
greedy, EOS ignored, prefix caching off; batch 1 is single-stream decode (127 / (T(128) - T(1))).
For the TP rows, rank 0's time inside collectives (all-reduces and the logits gather, waiting
for the other rank included) is reported as a share of the run's wall time. Each engine runs in
a subprocess of its own.

    python benchmarks/tensor_parallel.py                         # bf16 (~6 min on 2 cores)
    python benchmarks/tensor_parallel.py --dtype float32 --batches 1,32
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "tp1x2": dict(num_threads=2),
    "tp2x1": dict(tensor_parallel_size=2),
    "tp2x1g": dict(tensor_parallel_size=2, tensor_parallel_transport="gloo"),
    "dp2x1": dict(data_parallel_size=2),
}
ENGINE_KW = dict(enable_prefix_caching=False, max_num_seqs=256, max_num_batched_tokens=4096)


class TimedGroup:
    """Rank 0's TP group, timing every collective."""

    def __init__(self, group):
        self.group, self.rank, self.size, self.seconds = group, group.rank, group.size, 0.0

    def all_reduce_(self, t):
        t0 = time.perf_counter()
        out = self.group.all_reduce_(t)
        self.seconds += time.perf_counter() - t0
        return out

    def gather(self, t):
        t0 = time.perf_counter()
        out = self.group.gather(t)
        self.seconds += time.perf_counter() - t0
        return out


def run_one(name: str, dtype: str, batches: list[int]) -> dict:
    sys.path.insert(0, os.path.join(HERE, "peers"))
    import workload as w

    from engine import LLM, SamplingParams

    kw = CONFIGS[name]
    llm = LLM(dtype=dtype, multiprocess="data_parallel_size" in kw, **ENGINE_KW, **kw)
    timed = None
    if "tensor_parallel_size" in kw:
        model = llm.client.core.executor.worker.model
        timed = model.tp = TimedGroup(model.tp)

    def run(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    tok = llm.tokenizer
    run(w.prompt_texts(tok, w.QUESTIONS[:4]), 8)  # warm-up
    res = {}
    for b in batches:
        comm0 = timed.seconds if timed else 0.0
        if b == 1:
            single = w.prompt_texts(tok, [w.SINGLE_Q])
            t1 = min(run(single, 1) for _ in range(3))
            wall = run(single, w.MAX_NEW)
            res["b1"] = (w.MAX_NEW - 1) / (wall - t1)
        else:
            prompts = w.prompt_texts(tok, (w.QUESTIONS * (b // len(w.QUESTIONS) + 1))[:b])
            wall = run(prompts, w.MAX_NEW)
            res[f"b{b}"] = b * w.MAX_NEW / wall
        if timed:
            res[f"b{b}_comm"] = (timed.seconds - comm0) / wall
        print(f"  {name} batch {b}: {res[f'b{b}']:.1f} tok/s"
              + (f", collectives {100 * res[f'b{b}_comm']:.0f}% of rank 0's time" if timed else ""),
              file=sys.stderr, flush=True)
    llm.shutdown()
    return res


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(run_one(args.one, args.dtype, batches)))
        return
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.dtype}; greedy decode tok/s", flush=True)
    rows = {}
    for name in args.configs.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", name, "--dtype", args.dtype, "--batches",
                              args.batches], capture_output=False, stdout=subprocess.PIPE, text=True, check=True)
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    head = f"| {'engine':8} | " + " | ".join(f"batch {b:>3}" for b in batches) + " | collectives (rank 0) |"
    print(head)
    print("|" + "---|" * (len(batches) + 2))
    for name, r in rows.items():
        comm = " / ".join(f"{100 * r[f'b{b}_comm']:.0f}%" for b in batches) if f"b{batches[0]}_comm" in r else "-"
        print(f"| {name:8} | " + " | ".join(f"{r[f'b{b}']:9.1f}" for b in batches) + f" | {comm} |")


if __name__ == "__main__":
    main()
