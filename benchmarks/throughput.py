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
engine-core replicas (data parallelism; the cores split between them); ours_eager = ours op by op
(enforce_eager: no CUDA graphs; on a CPU no C++ decode layer loop); ours_async, ours_mp_async =
ours, ours_mp with async_scheduling (step N+1 scheduled while step N runs, in a thread of its own); ours_int8kv = ours with
kv_cache_dtype "int8" (8-bit keys and values, a scale per token and kv head; CPU); ours_bi = ours in
batch-invariant mode (float32 only: fixed-order matmuls and per-token attention); async = AsyncLLM, one
concurrent generate() per prompt, DELTA outputs, which also reports the frontend's median
per-token latency (engine core queued the token -> the caller's async-for received it);
floor = the model's decode matmuls alone through plain F.linear at that batch size (every
layer's q/k/v, o, gate/up and down and the LM head, the model's shapes, random weights): the
"F.linear floor" (docs/performance.md), which prepacked weights can beat. Its single-stream row also
gives the weight-read bound: measured read bandwidth / weight bytes per token.

--device cuda runs every engine on the GPU (transformers with SDPA attention; ours_bi and ours_dp2 are
CPU-only here and skipped), adds each in-process engine's peak GPU memory, and a batch-1 roofline:
the device's bandwidth measured in the same run (a 2 GiB device-to-device copy, bytes read + written)
over the weight bytes one decode token reads gives the floor tok/s each single-stream row is put
against. --model takes any local Llama-family folder (benchmarks/random_llama.py writes random-weight
ones); the default is the embedded default model.

    python benchmarks/throughput.py                       # everything (~10 min on 2 cores)
    python benchmarks/throughput.py --dtypes bfloat16 --batches 32 --reps 1
    python benchmarks/throughput.py --device cuda --model /tmp/llama-1b --engines hf,ours \
        --dtypes bfloat16 --batches 1,32,128,256
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
sys.path.insert(0, os.path.dirname(HERE))  # `engine` without an installed package (a bare GPU machine)


def workload():
    sys.path.insert(0, PEERS)
    import workload as w

    return w


ENGINE_KW = dict(enable_prefix_caching=False, max_num_seqs=256, max_num_batched_tokens=4096)
# On CUDA a fixed KV cache rather than 90% of the card: the same engine on an H100 and an H200, and a
# peak-memory column that shows the engine, not the card. 8 GiB holds 256 x (prompt + 128) tokens of
# a 1B Llama (16 layers, 8 KV heads of 64) in float32 about 2.5 times over.
CUDA_KW = dict(kv_cache_memory=8 << 30)
CPU_ONLY = ("ours_bi", "ours_dp2", "ours_int8kv")  # batch-invariant: CPU float32; dp2: a second device


def engine_kw(device, model):
    return dict(ENGINE_KW, device=device, model=model, **(CUDA_KW if device == "cuda" else {}))


def run_ours(dtype, batches, reps, device, model, multiprocess=False, data_parallel_size=1, batch_invariant=False,
             enforce_eager=False, async_scheduling=False, kv_cache_dtype="auto"):
    from engine import LLM, SamplingParams

    w = workload()
    t = time.perf_counter()
    llm = LLM(dtype=dtype, multiprocess=multiprocess, data_parallel_size=data_parallel_size,
              batch_invariant=batch_invariant, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
              kv_cache_dtype=kv_cache_dtype, **engine_kw(device, model))
    load_s = time.perf_counter() - t

    # No CUDA synchronize around generate(): it returns once the last step's sampled tokens are on
    # the host, so the GPU is done; and a frontend whose engine core runs in another process must
    # not open a CUDA context of its own.
    def run(prompts, sample, n):
        sp = SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    res = measure(w, llm.tokenizer, run, batches, reps, load_s, device)
    if multiprocess:
        res["peak_rss_mb"] += llm.get_stats()["peak_rss_mb"]
    elif device == "cuda":
        res["peak_gpu_mb"] = peak_gpu_mb()
    model_config = llm.config.model_config
    llm.shutdown()
    if device == "cuda" and not multiprocess and 1 in batches:
        res.update(roofline(model_config, dtype))
    return res


def run_ours_mp(dtype, batches, reps, device, model):
    return run_ours(dtype, batches, reps, device, model, multiprocess=True)


def run_ours_dp2(dtype, batches, reps, device, model):
    """Two engine-core replicas, the cores split between them (one thread each here)."""
    return run_ours(dtype, batches, reps, device, model, multiprocess=True, data_parallel_size=2)


def run_ours_eager(dtype, batches, reps, device, model):
    """Every step op by op: no CUDA graphs, on a CPU no C++ layer loop (what each buys)."""
    return run_ours(dtype, batches, reps, device, model, enforce_eager=True)


def run_ours_async(dtype, batches, reps, device, model):
    """Async scheduling: what overlapping the host's share of a step with the forward saves."""
    return run_ours(dtype, batches, reps, device, model, async_scheduling=True)


def run_ours_mp_async(dtype, batches, reps, device, model):
    return run_ours(dtype, batches, reps, device, model, multiprocess=True, async_scheduling=True)


def run_ours_int8kv(dtype, batches, reps, device, model):
    """An int8 KV cache: what reading half the bytes in attention saves."""
    return run_ours(dtype, batches, reps, device, model, kv_cache_dtype="int8")


def run_ours_bi(dtype, batches, reps, device, model):
    """Batch-invariant mode (float32 only): what bit-identical logprobs across batches cost."""
    return run_ours(dtype, batches, reps, device, model, batch_invariant=True)


def run_async(dtype, batches, reps, device, model):
    import asyncio
    import statistics

    from engine import RequestOutputKind, SamplingParams
    from engine.frontend.async_llm import AsyncLLM

    w = workload()
    loop = asyncio.new_event_loop()
    t = time.perf_counter()
    llm = AsyncLLM(dtype=dtype, **engine_kw(device, model))
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

    res = measure(w, llm.tokenizer, run, batches, reps, load_s, device)
    res["frontend_lag_ms_p50"] = statistics.median(lags) * 1e3
    _log(f"  frontend per-token latency (core -> caller), median: {res['frontend_lag_ms_p50']:.2f} ms")
    res["peak_rss_mb"] += loop.run_until_complete(llm.get_stats())["peak_rss_mb"]
    llm.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the output handler see its cancellation
    return res


def run_floor(dtype, batches, reps, device, model):
    import torch
    import torch.nn.functional as F

    from engine.config import ModelConfig
    from engine.default_model import resolve_model

    set_cpu_threads(device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    mc = ModelConfig.from_folder(resolve_model(model))
    q, kv, H, inter = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    shapes = [(q + 2 * kv, H), (H, q), (2 * inter, H), (H, inter)] * mc.num_layers + [(mc.vocab_size, H)]
    dt = getattr(torch, dtype)
    weights = [torch.randn(n, k, device=device).to(dt) for n, k in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    res = {"load_s": 0.0}

    def step_s(b: int) -> float:
        xs = {k: torch.randn(b, k, device=device).to(dt) for _, k in shapes}
        for w in weights:  # warm-up
            F.linear(xs[w.shape[1]], w)
        times = []
        for _ in range(max(reps, 3)):
            sync()
            t0 = time.perf_counter()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    for b in batches:
        key = "single_decode_tok_s" if b == 1 else f"b{b}_greedy_tok_s"
        res[key] = b / step_s(b)
        _log(f"  batch {b}: {res[key]:.0f} tok/s (matmuls only)")
    big = torch.ones(weight_bytes // 4, dtype=torch.float32, device=device)  # the weights' bytes, read by sum()
    big.sum()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    sync()
    res["read_gb_s"] = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    res["weight_mb"] = weight_bytes / 1e6
    res["weight_bound_tok_s"] = res["read_gb_s"] * 1e9 / weight_bytes
    _log(f"  read bandwidth {res['read_gb_s']:.1f} GB/s, {res['weight_mb']:.0f} MB of weights per token: "
         f"single stream bound {res['weight_bound_tok_s']:.1f} tok/s")
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def run_hf(dtype, batches, reps, device, model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.default_model import resolve_model

    w = workload()
    set_cpu_threads(device)
    t = time.perf_counter()
    path = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(path)
    kw = dict(attn_implementation="sdpa") if device == "cuda" else {}  # CPU keeps transformers' own default
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw).to(device).eval()
    load_s = time.perf_counter() - t
    hf.generation_config.eos_token_id = None  # or generate() refills EOS from it
    tok.padding_side = "left"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None

    def run(prompts, sample, n):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id)
        kw.update(dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if sample else dict(do_sample=False))
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(**enc, generation_config=GenerationConfig(**kw))
        sync()  # generate() can return with kernels still queued on the GPU
        return time.perf_counter() - t0, out[:, enc["input_ids"].shape[1]:].tolist()

    res = measure(w, tok, run, batches, reps, load_s, device)
    if device == "cuda":
        res["peak_gpu_mb"] = peak_gpu_mb()
    return res


def set_cpu_threads(device):
    """All cores for the CPU runs (torch's default can be fewer); on CUDA the host threads only launch."""
    if device == "cpu":
        import torch

        torch.set_num_threads(os.cpu_count())


def peak_gpu_mb():
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def roofline(mc, dtype) -> dict:
    """The batch-1 decode floor on this GPU: measured bandwidth / weight bytes read per token."""
    import torch

    if mc.moe is not None:  # a decode token reads only its experts: decode_weight_bytes() counts all
        _log("  roofline: skipped (a mixture-of-experts model)")
        return {}
    weight_bytes = decode_weight_bytes(mc, getattr(torch, dtype).itemsize)
    gb_s = copy_bandwidth_gb_s()
    res = {"copy_gb_s": gb_s, "decode_weight_mb": weight_bytes / 1e6, "floor_tok_s": gb_s * 1e9 / weight_bytes}
    _log(f"  roofline: copy bandwidth {gb_s:.0f} GB/s, {res['decode_weight_mb']:.0f} MB of weights per token: "
         f"floor {res['floor_tok_s']:.0f} tok/s")
    return res


def decode_weight_bytes(mc, itemsize: int) -> int:
    """Weight bytes one batch-1 decode step reads (a dense model): every layer's projections and
    norms, the final norm and the LM head. A tied embedding counts once, as the LM head; an untied
    one is left out, since the input lookup reads a single row of it."""
    H, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_layer = H * (q + 2 * kv) + q * H + 3 * H * mc.intermediate_size + 2 * H  # qkv, o, gate/up/down, 2 norms
    per_layer += (q + 2 * kv) * mc.qkv_bias + 2 * mc.head_dim * mc.qk_norm
    return itemsize * (mc.num_layers * per_layer + H + mc.vocab_size * H)


def copy_bandwidth_gb_s(nbytes: int = 2 << 30, reps: int = 5) -> float:
    """GPU memory bandwidth: a device-to-device copy of `nbytes`, bytes read + written over the
    time (CUDA events), best of `reps` after a warm-up."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_s = float("inf")
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best_s = min(best_s, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best_s / 1e9


def measure(w, tok, run, batches, reps, load_s, device):
    if device == "cuda":
        # Every batch size once, greedy and sampled, untimed: on a GPU the first all-decode step of a
        # new size captures its CUDA graph (and kernels compile for new shapes), and the workload
        # times batches above 32 only once. 16 tokens: the prompts of batch 256 prefill in ~3 steps
        # of 4096 tokens, and the steps after them are all-decode at the full batch.
        for b in batches:
            prompts = w.prompt_texts(tok, [w.SINGLE_Q] if b == 1 else (w.QUESTIONS * (b // len(w.QUESTIONS) + 1))[:b])
            for sample in (False, True):
                run(prompts, sample, 16)
    return w.measure(tok, run, batches, reps, load_s)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


ENGINES = {"floor": run_floor, "hf": run_hf, "ours": run_ours, "ours_mp": run_ours_mp, "ours_dp2": run_ours_dp2,
           "ours_bi": run_ours_bi, "ours_eager": run_ours_eager, "ours_async": run_ours_async,
           "ours_int8kv": run_ours_int8kv,
           "ours_mp_async": run_ours_mp_async, "async": run_async}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="hf,ours,ours_mp,async")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", help="a local model folder (default: the embedded default model)")
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        engine, dtype = args.worker
        res = ENGINES[engine](dtype, batches, args.reps, args.device, args.model)
        if args.device == "cuda":  # after the engine's shutdown: a frontend opens no CUDA context while it runs
            import torch

            res["device_name"] = torch.cuda.get_device_name()
        print(json.dumps(res))
        return
    results = {}
    for dtype in args.dtypes.split(","):
        for engine in args.engines.split(","):
            if engine == "ours_bi" and dtype != "float32":
                continue  # batch-invariant mode runs float32 only
            if engine in CPU_ONLY and args.device != "cpu":
                _log(f"[bench] {engine}: CPU only here, skipped")
                continue
            _log(f"[bench] {engine} {dtype} ...")
            cmd = [sys.executable, __file__, "--worker", engine, dtype, "--batches", args.batches,
                   "--reps", str(args.reps), "--device", args.device] + (["--model", args.model] if args.model else [])
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True,
                                 env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
            results[(engine, dtype)] = json.loads(out.stdout.strip().splitlines()[-1])
    print_table(results, batches, args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{e}_{d}": r for (e, d), r in results.items()}, f, indent=1)


def print_table(results, batches, model):
    sys.path.insert(0, HERE)
    from timing import machine_line

    gpus = {r["device_name"] for r in results.values() if "device_name" in r}
    if gpus:  # the host CPU's SIMD features do not bound a GPU run: the GPU leads, the host follows
        print(f"device: {', '.join(sorted(gpus))}; host {machine_line()}")
    else:
        print(machine_line())
    if model:
        print(f"model: {model}")
    gpu_col = any("peak_gpu_mb" in r for r in results.values())
    cols = [f"b{b}_{m}_tok_s" for b in batches if b != 1 for m in ("greedy", "sample")]
    head = ["engine", "dtype"] + [c.replace("_tok_s", "") for c in cols] + ["single", "peak MB"] + \
        ["GPU MB"] * gpu_col + ["load s", "lag ms"]
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
        gpu_mb = r.get("peak_gpu_mb")
        cells += ["-" if v is None else f"{v:.1f}{ratio}", f"{r['peak_rss_mb']:.0f}"]
        cells += [("-" if gpu_mb is None else f"{gpu_mb:.0f}")] * gpu_col
        cells += [f"{r['load_s']:.1f}", "-" if lag is None else f"{lag:.2f}"]
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
        if "floor_tok_s" in r:
            singles = [(e, s["single_decode_tok_s"]) for (e, d), s in results.items()
                       if d == dtype and "single_decode_tok_s" in s]
            singles = ", ".join(f"{e} {v:.0f} tok/s = {100 * v / r['floor_tok_s']:.1f}%" for e, v in singles)
            print(f"roofline {dtype}, batch 1: copy bandwidth {r['copy_gb_s']:.0f} GB/s (read + written), "
                  f"{r['decode_weight_mb']:.0f} MB of weights per token -> floor {r['floor_tok_s']:.0f} tok/s; "
                  f"{singles} of the floor")
    print("tok/s; (x) = ratio to transformers in the same run; single = single-stream greedy decode tok/s;\n"
          "lag ms = median time from the engine core queuing a token to the AsyncLLM caller receiving it")
    if gpu_col:
        print("GPU MB = peak torch.cuda.max_memory_allocated() of the engines that run the model in process")


if __name__ == "__main__":
    main()
