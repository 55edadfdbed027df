"""Where one decode step's time goes (batch 32, bfloat16 by default, greedy, the engine core in
process; the step that prefills the prompts is left out): wall time of the engine step split
into matmuls (every projection and the LM head), attention, the small fused ops (norms, rotary +
KV write, SiLU), the rest of the forward pass (embedding, views, Python), sampling, input
preparation, and scheduling + output assembly.

    python benchmarks/step_profile.py [--dtype bfloat16] [--batch 32] [--tokens 128] [--temperature 0]
    python benchmarks/step_profile.py --dtype float32 --batch 128 --kv-cache-dtype int8
    python benchmarks/step_profile.py --device cuda --model FOLDER --batch 1 --cprofile 30

On a CPU the decoder layers of a decode step are one C++ call (engine/model/decoder.py's
DecodePlan), timed as one row; --enforce-eager runs them op by op from Python, as split above.
On CUDA the forward pass of a decode step is one CUDA-graph replay, so the split is the host's:
the kernels run asynchronously and the host waits for them where sampling reads the tokens back
("sampling" holds that wait). --cprofile N adds the N functions with the most own time over the
timed run (Python's profiler: it slows Python code several-fold, so read it for shares). --kernels N
adds, from torch's profiler over 8 more decode steps, the N kernels with the most device time and
the number of kernel launches a step (on CUDA: what a graph replay runs, kernel by kernel).

The functions are wrapped with perf_counter accumulators in this script only (~0.3 us a call,
~100 us a step); the decode matmul floor for comparison is measured by benchmarks in
DESIGN.md's terms: the same projections, called back to back.
"""
import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOTALS = defaultdict(float)


def timed(labels, fn):
    """fn, adding its time to TOTALS under each of `labels` (one name, or a tuple)."""
    labels = (labels,) if isinstance(labels, str) else labels

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            for label in labels:
                TOTALS[label] += time.perf_counter() - t
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (no filters)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="a local model folder (default: the default model)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N functions with most own time")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also print the N kernels with most device time (CUDA)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="op by op: no CUDA graphs; on a CPU no C++ layer loop (the split by op needs it)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="step N+1 launched before step N is read back (the parts then overlap: read the step time)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or int8 (CPU)")
    args = ap.parse_args()
    if args.kernels and args.device != "cuda":
        ap.error("--kernels reads CUDA kernels (on a CPU our C++ kernels are no torch ops: the profiler misses them)")

    import engine.core.engine_core as core_mod
    import engine.model.decoder as model_mod
    import engine.worker.model_runner as runner_mod
    from engine import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
    from workload import QUESTIONS, prompt_texts

    llm = LLM(args.model, dtype=args.dtype, device=args.device, multiprocess=False, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
              async_scheduling=args.async_scheduling,
              max_num_seqs=256, max_num_batched_tokens=8192,
              **(dict(kv_cache_memory=4 << 30) if args.device == "cuda" else {}))
    prompts = prompt_texts(llm.tokenizer, (QUESTIONS * 8)[:args.batch])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up

    # wrap: the step, the runner's pieces, the model's pieces
    # Decode steps only: the step that prefills every prompt (the token budget below fits them
    # all) is timed but then dropped from the totals.
    timed_step = timed("step", core_mod.EngineCore.step)
    decode_start = []

    def step(self, *a, **kw):
        out = timed_step(self, *a, **kw)
        if not decode_start:
            TOTALS.clear()
            decode_start.append(time.perf_counter())
        return out
    core_mod.EngineCore.step = step
    # a step is its launch, then reading its samples back (in the core's thread with async scheduling)
    runner_mod.ModelRunner.launch = timed("execute", runner_mod.ModelRunner.launch)
    runner_mod.ModelRunner.sample = timed("sampling", runner_mod.ModelRunner.sample)
    runner_mod.ModelRunner.samples_to_host = staticmethod(timed(("sampling", "execute"),
                                                                runner_mod.ModelRunner.samples_to_host))
    runner_mod.ModelRunner._forward = timed("forward", runner_mod.ModelRunner._forward)  # (a graph replay on CUDA)
    model_mod.LlamaModel.compute_logits = timed("lm_head", model_mod.LlamaModel.compute_logits)
    model_mod.Linear.__call__ = timed("projections", model_mod.Linear.__call__)
    ops = llm.client.core.executor.worker.model.ops  # the per-layer ops the forward pass calls
    for name in ("add_norm", "rope_and_cache", "silu_and_mul"):
        setattr(ops, name, timed("small fused ops", getattr(ops, name)))
    if ops.decode_attention is not None:
        ops.decode_attention = timed("attention", ops.decode_attention)
    model_mod.attention = timed("attention", model_mod.attention)  # steps with prefill chunks

    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - decode_start[0]
    if args.cprofile:
        profiler.disable()
    steps = args.tokens - 1  # decode steps: the first token comes from the prefill step
    lm_head_in_projections = TOTALS["lm_head"]  # compute_logits calls Linear too
    per_op = TOTALS["projections"] > lm_head_in_projections  # else the C++ decode plan ran the layers
    rows = [
        ("matmuls: projections", TOTALS["projections"] - lm_head_in_projections),
        ("matmuls: LM head", TOTALS["lm_head"]),
        ("attention (paged decode / prefill kernels)", TOTALS["attention"]),
        ("norms, rotary + KV write, SiLU*up", TOTALS["small fused ops"]),
        ("rest of forward (embedding, views, Python)" if per_op
         else "decoder layers, one C++ call (see --enforce-eager)",
         TOTALS["forward"] - (TOTALS["projections"] - lm_head_in_projections) - TOTALS["attention"]
         - TOTALS["small fused ops"]),
        ("sampling (+ logprobs)", TOTALS["sampling"]),
        ("input preparation", TOTALS["execute"] - TOTALS["forward"] - TOTALS["lm_head"] - TOTALS["sampling"]),
        ("scheduler, outputs, detokenize", wall - TOTALS["execute"]),
    ]
    kv = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    print(f"decode step breakdown: batch {args.batch}, {args.dtype}{kv}, temperature {args.temperature}, "
          f"{steps} steps, {wall / steps * 1e3:.2f} ms/step, {args.batch * steps / wall:.0f} tok/s")
    if args.async_scheduling:
        print("(async scheduling: the step thread's parts overlap the core's, so the last rows do not add up)")
    print(f"{'part':50s} {'ms/step':>8s} {'share':>6s}")
    for name, secs in rows if per_op else rows[1:2] + rows[4:]:
        print(f"{name:50s} {secs / steps * 1e3:8.2f} {secs / wall * 100:5.1f}%")
    if args.cprofile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    if args.kernels:
        kernel_table(llm, prompts, args, wall / steps)
    llm.shutdown()


def kernel_table(llm, prompts, args, step_s: float):
    """torch.profiler over the decode steps of a short run (its prefill step included, then
    subtracted by running the prefill alone): the kernels by device time, and launches a step;
    against `step_s`, the timed run's seconds a step: how much of a step the GPU is busy."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    def kernels(max_tokens):
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        return {e.key: e for e in prof.key_averages() if e.device_type.name == "CUDA"}

    steps = 8
    one, many = kernels(1), kernels(1 + steps)  # the prefill step alone, then with `steps` decode steps
    rows = [(key, e.device_time_total - (one[key].device_time_total if key in one else 0),
             e.count - (one[key].count if key in one else 0)) for key, e in many.items()]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[1])
    busy_us = sum(r[1] for r in rows) / steps
    print(f"device time of {steps} decode steps by kernel: {busy_us:.0f} us a step, "
          f"{sum(r[2] for r in rows) / steps:.0f} launches a step; the GPU busy {busy_us / (step_s * 1e6):.0%} "
          f"of the timed run's {step_s * 1e3:.2f} ms step")
    for key, us, count in rows[:args.kernels]:
        print(f"  {us / steps:8.1f} us/step {count / steps:6.1f}/step  {key[:90]}")


if __name__ == "__main__":
    main()
