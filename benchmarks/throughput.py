"""Throughput of the offline engine beside transformers `generate()`, measured in one run.

Workload (benchmarks/peers/workload.py; benchmarks/peers.py runs peer engines on the same one):
32 chat prompts, 128 new tokens each, EOS ignored, greedy and temperature 1.0 (top-p 1, top-k
off); batch sizes 1, 32 and 128 (the 32 questions repeated); single-stream decode tok/s =
127 / (T(128 tokens) - T(1 token)). Each (engine, dtype) runs in its own subprocess, so peak
memory (max RSS) is that engine's alone (for the multi-process engines: frontend + engine
core). Prefix caching is off for our engines here, so repeated prompts are not served from the
cache.

Engines: hf = transformers generate (left-padded batch); ours = LLM with the engine core in
process; ours_mp = LLM through the engine-core process (the default); ours_dp2 = LLM with two
engine-core replicas (data parallelism; the cores split between them); ours_bi = ours in
batch-invariant mode (float32 only: fixed-order matmuls and per-token attention); async = AsyncLLM, one
concurrent generate() per prompt, DELTA outputs, which also reports the frontend's median
per-token latency (engine core queued the token -> the caller's async-for received it);
floor = the model's decode matmuls alone through plain F.linear at that batch size (every
layer's q/k/v, o, gate/up and down and the LM head, the model's shapes, random weights): the
"F.linear floor" (docs/performance.md), which prepacked weights can beat. Its single-stream row also
gives the weight-read bound: measured read bandwidth / weight bytes per token.

    python benchmarks/throughput.py                       # everything (~10 min on 2 cores)
    python benchmarks/throughput.py --dtypes bfloat16 --batches 32 --reps 1
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")


def workload():
    sys.path.insert(0, PEERS)
    import workload as w

    return w


ENGINE_KW = dict(enable_prefix_caching=False, max_num_seqs=256, max_num_batched_tokens=4096)


def run_ours(dtype, batches, reps, multiprocess=False, data_parallel_size=1, batch_invariant=False):
    from engine import LLM, SamplingParams

    w = workload()
    t = time.perf_counter()
    llm = LLM(dtype=dtype, multiprocess=multiprocess, data_parallel_size=data_parallel_size,
              batch_invariant=batch_invariant, **ENGINE_KW)
    load_s = time.perf_counter() - t

    def run(prompts, sample, n):
        sp = SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    res = measure(w, llm.tokenizer, run, batches, reps, load_s)
    if multiprocess:
        res["peak_rss_mb"] += llm.get_stats()["peak_rss_mb"]
    llm.shutdown()
    return res


def run_ours_mp(dtype, batches, reps):
    return run_ours(dtype, batches, reps, multiprocess=True)


def run_ours_dp2(dtype, batches, reps):
    """Two engine-core replicas, the cores split between them (one thread each here)."""
    return run_ours(dtype, batches, reps, multiprocess=True, data_parallel_size=2)


def run_ours_bi(dtype, batches, reps):
    """Batch-invariant mode (float32 only): what bit-identical logprobs across batches cost."""
    return run_ours(dtype, batches, reps, batch_invariant=True)


def run_async(dtype, batches, reps):
    import asyncio
    import statistics

    from engine import RequestOutputKind, SamplingParams
    from engine.frontend.async_llm import AsyncLLM

    w = workload()
    loop = asyncio.new_event_loop()
    t = time.perf_counter()
    llm = AsyncLLM(dtype=dtype, **ENGINE_KW)
    load_s = time.perf_counter() - t
    lags = []

    async def one(prompt, sp):
        tokens = []
        async for out in llm.generate(prompt, sp):
            lags.append(time.monotonic() - out.core_timestamp)
            tokens += out.outputs[0].token_ids
        return tokens

    async def batch(prompts, sp):
        return await asyncio.gather(*[one(p, sp) for p in prompts])

    def run(prompts, sample, n):
        sp = SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=n, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        outs = loop.run_until_complete(batch(prompts, sp))
        return time.perf_counter() - t0, outs

    res = measure(w, llm.tokenizer, run, batches, reps, load_s)
    res["frontend_lag_ms_p50"] = statistics.median(lags) * 1e3
    _log(f"  frontend per-token latency (core -> caller), median: {res['frontend_lag_ms_p50']:.2f} ms")
    res["peak_rss_mb"] += loop.run_until_complete(llm.get_stats())["peak_rss_mb"]
    llm.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the output handler see its cancellation
    return res


def run_floor(dtype, batches, reps):
    import torch
    import torch.nn.functional as F

    from engine.config import ModelConfig
    from engine.default_model import resolve_model

    torch.set_num_threads(os.cpu_count())
    mc = ModelConfig.from_folder(str(resolve_model(None)))
    q, kv, H, inter = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    shapes = [(q + 2 * kv, H), (H, q), (2 * inter, H), (H, inter)] * mc.num_layers + [(mc.vocab_size, H)]
    dt = getattr(torch, dtype)
    weights = [torch.randn(n, k).to(dt) for n, k in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    res = {"load_s": 0.0}

    def step_s(b: int) -> float:
        xs = {k: torch.randn(b, k).to(dt) for _, k in shapes}
        for w in weights:  # warm-up
            F.linear(xs[w.shape[1]], w)
        times = []
        for _ in range(max(reps, 3)):
            t0 = time.perf_counter()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
        return min(times)

    for b in batches:
        key = "single_decode_tok_s" if b == 1 else f"b{b}_greedy_tok_s"
        res[key] = b / step_s(b)
        _log(f"  batch {b}: {res[key]:.0f} tok/s (matmuls only)")
    big = torch.ones(weight_bytes // 4, dtype=torch.float32)  # as many bytes as the weights, read by sum()
    big.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    res["read_gb_s"] = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    res["weight_mb"] = weight_bytes / 1e6
    res["weight_bound_tok_s"] = res["read_gb_s"] * 1e9 / weight_bytes
    _log(f"  read bandwidth {res['read_gb_s']:.1f} GB/s, {res['weight_mb']:.0f} MB of weights per token: "
         f"single stream bound {res['weight_bound_tok_s']:.1f} tok/s")
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def run_hf(dtype, batches, reps):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.default_model import default_model_path

    w = workload()
    torch.set_num_threads(os.cpu_count())
    t = time.perf_counter()
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t
    model.generation_config.eos_token_id = None  # or generate() refills EOS from it
    tok.padding_side = "left"

    def run(prompts, sample, n):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id)
        kw.update(dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if sample else dict(do_sample=False))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=GenerationConfig(**kw))
        return time.perf_counter() - t0, out[:, enc["input_ids"].shape[1]:].tolist()

    return measure(w, tok, run, batches, reps, load_s)


def measure(w, tok, run, batches, reps, load_s):
    return w.measure(tok, run, batches, reps, load_s)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


ENGINES = {"floor": run_floor, "hf": run_hf, "ours": run_ours, "ours_mp": run_ours_mp, "ours_dp2": run_ours_dp2,
           "ours_bi": run_ours_bi, "async": run_async}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="hf,ours,ours_mp,async")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        engine, dtype = args.worker
        print(json.dumps(ENGINES[engine](dtype, batches, args.reps)))
        return
    results = {}
    for dtype in args.dtypes.split(","):
        for engine in args.engines.split(","):
            if engine == "ours_bi" and dtype != "float32":
                continue  # batch-invariant mode runs float32 only
            _log(f"[bench] {engine} {dtype} ...")
            cmd = [sys.executable, __file__, "--worker", engine, dtype, "--batches", args.batches,
                   "--reps", str(args.reps)]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True,
                                 env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
            results[(engine, dtype)] = json.loads(out.stdout.strip().splitlines()[-1])
    print_table(results, batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{e}_{d}": r for (e, d), r in results.items()}, f, indent=1)


def print_table(results, batches):
    sys.path.insert(0, HERE)
    from timing import machine_line

    print(machine_line())
    cols = [f"b{b}_{m}_tok_s" for b in batches if b != 1 for m in ("greedy", "sample")]
    head = ["engine", "dtype"] + [c.replace("_tok_s", "") for c in cols] + ["single", "peak MB", "load s",
                                                                              "lag ms"]
    rows = []
    for (engine, dtype), r in results.items():
        hf = results.get(("hf", dtype), {})
        cells = [engine, dtype]
        for c in cols:
            v = r.get(c)
            ratio = f" ({v / hf[c]:.2f}x)" if engine != "hf" and v and hf.get(c) else ""
            cells.append("-" if v is None else f"{v:.0f}{ratio}")
        v = r.get("single_decode_tok_s")
        base = hf.get("single_decode_tok_s")
        ratio = f" ({v / base:.2f}x)" if engine != "hf" and v and base else ""
        lag = r.get("frontend_lag_ms_p50")
        cells += ["-" if v is None else f"{v:.1f}{ratio}", f"{r['peak_rss_mb']:.0f}", f"{r['load_s']:.1f}",
                  "-" if lag is None else f"{lag:.2f}"]
        rows.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    for (engine, dtype), r in results.items():
        if engine == "floor":
            print(f"floor {dtype}: read bandwidth {r['read_gb_s']:.1f} GB/s, {r['weight_mb']:.0f} MB of weights per "
                  f"token -> single-stream weight-read bound {r['weight_bound_tok_s']:.1f} tok/s")
    print("tok/s; (x) = ratio to transformers in the same run; single = single-stream greedy decode tok/s;\n"
          "lag ms = median time from the engine core queuing a token to the AsyncLLM caller receiving it")


if __name__ == "__main__":
    main()
