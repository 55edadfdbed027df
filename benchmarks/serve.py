"""Serving benchmark: N concurrent streaming clients against `rollout serve` over HTTP, beside
the same workload on AsyncLLM in process (no HTTP), measured in one run.

Each client loops: one streaming /v1/chat/completions request (chat prompts from the shared peer
workload, EOS ignored, `max_tokens` new tokens, return_token_ids so every token is counted), then
the next, until `--duration` seconds have passed or `--num-requests` were issued (requests in
flight then finish). Reported: requests/s and generated tokens/s over the run's wall time, time to
first token (request sent -> first token received), inter-token latency (gap between tokens of
one request; a chunk of k tokens counts k gaps of gap/k) and end-to-end latency, p50/p90/p99.
The "engine" row runs the same clients as coroutines calling AsyncLLM.generate (DELTA outputs)
in a subprocess: the ratio row is what HTTP + JSON + SSE cost. On a shared 2-core CPU the absolute
numbers are noisy; read the ratios.

    python benchmarks/serve.py                          # starts a server (~1.5 min in all)
    python benchmarks/serve.py --url http://127.0.0.1:8000 --api-key KEY --no-engine
    python benchmarks/serve.py --concurrency 16 --duration 60 --max-tokens 128 --dtype float32
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from rollout.subprocess_server import ServerProcess, start  # noqa: E402


def questions() -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "..", "shared", "peers"))
    try:
        from workload import QUESTIONS
        return list(QUESTIONS)
    except ImportError:
        return ["What is 17 + 25?", "Name three primary colors.", "Who wrote Romeo and Juliet?",
                "What is the largest ocean on Earth?", "Explain briefly why the sky is blue."]


class Recorder:
    """Per request: [send time, token arrival times, end time (None: cut off at the deadline)]."""

    def __init__(self):
        self.requests: list[list] = []

    def start(self) -> list:
        entry = [time.perf_counter(), [], None]
        self.requests.append(entry)
        return entry

    def summary(self, wall_s: float) -> dict:
        done = [r for r in self.requests if r[2] is not None]
        ttft = [times[0] - t0 for t0, times, _ in self.requests if times]
        itl = [b - a for _, times, _ in self.requests for a, b in zip(times, times[1:])]
        ntok = sum(len(times) for _, times, _ in self.requests)
        return {"requests": len(done), "cut_off": len(self.requests) - len(done), "tokens": ntok, "wall_s": wall_s,
                "req_per_s": len(done) / wall_s, "tok_per_s": ntok / wall_s, "ttft": percentiles(ttft),
                "itl": percentiles(itl), "e2e": percentiles([t_end - t0 for t0, _, t_end in done])}


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def arrive(times: list[float], now: float, k: int) -> None:
    """k tokens arrived together at `now`: the first chunk's all count as first tokens; a later
    chunk's are spread evenly since the previous token (k gaps of gap / k)."""
    if not times:
        times.extend([now] * k)
        return
    last = times[-1]
    times.extend(last + (now - last) * i / k for i in range(1, k + 1))


async def drive(one_request, prompts: list, concurrency: int, duration: float, max_requests: int) -> dict:
    """`concurrency` clients issue requests back to back; at `duration` s the run stops, and
    requests still in flight are cancelled (their tokens so far count, their latency does not)."""
    rec, issued = Recorder(), [0]
    t_start = time.perf_counter()

    async def client():
        while issued[0] < max_requests:
            prompt = prompts[issued[0] % len(prompts)]
            issued[0] += 1
            entry = rec.start()
            await one_request(prompt, entry[1])
            entry[2] = time.perf_counter()

    tasks = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    await asyncio.wait(tasks, timeout=duration)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return rec.summary(time.perf_counter() - t_start)


async def run_http(url: str, api_key, prompts, args) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one(question: str, times: list, max_tokens: int = args.max_tokens):
            body = {"model": model, "messages": [{"role": "user", "content": question}], "stream": True,
                    "max_tokens": max_tokens, "temperature": args.temperature, "ignore_eos": True,
                    "return_token_ids": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:])["choices"]
                    k = len(choices[0].get("token_ids") or []) if choices else 0
                    if k:
                        arrive(times, time.perf_counter(), k)

        # warm-up: one concurrent wave (first-call and first-shape costs are not serving costs)
        await asyncio.gather(*(one(p, [], 4) for p in prompts[:args.concurrency]))
        return await drive(one, prompts, args.concurrency, args.duration, args.num_requests)


def run_engine(args) -> dict:
    """The same clients on AsyncLLM in this process (run in a subprocess by main)."""
    from engine.frontend.async_llm import AsyncLLM
    from engine.sampling_params import RequestOutputKind, SamplingParams

    async def main():
        llm = AsyncLLM(dtype=args.dtype, max_model_len=args.max_model_len, data_parallel_size=args.data_parallel_size)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=False) for q in questions()]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        counter = [0]

        async def one(prompt: str, times: list, params: SamplingParams = sp):
            counter[0] += 1
            async for out in llm.generate(prompt, params, request_id=f"b{counter[0]}"):
                k = len(out.outputs[0].token_ids)
                if k:
                    arrive(times, time.perf_counter(), k)

        try:
            await asyncio.gather(*(one(p, [], sp.clone(max_tokens=4)) for p in prompts[:args.concurrency]))
            return await drive(one, prompts, args.concurrency, args.duration, args.num_requests)
        finally:
            llm.shutdown()

    return asyncio.run(main())


def start_server(args, api_servers: int = 1) -> ServerProcess:
    log = tempfile.NamedTemporaryFile("w", prefix="bench-serve-", suffix=".log", delete=False)
    log.close()
    try:
        return start("--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--api-server-count",
                     str(api_servers), "--data-parallel-size", str(args.data_parallel_size), log_path=log.name,
                     cwd=ROOT)
    except RuntimeError as e:
        sys.exit(str(e))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def print_table(rows: list[tuple[str, dict]], args) -> None:
    def ms(d):
        return "/".join(f"{d[p] * 1e3:.0f}" for p in ("p50", "p90", "p99"))

    def s(d):
        return "/".join(f"{d[p]:.2f}" for p in ("p50", "p90", "p99"))

    head = ["run", "req/s", "tok/s", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "E2E s p50/p90/p99",
            "done", "cut off", "tokens"]
    table = [[name, f"{r['req_per_s']:.2f}", f"{r['tok_per_s']:.1f}", ms(r["ttft"]), ms(r["itl"]), s(r["e2e"]),
              str(r["requests"]), str(r["cut_off"]), str(r["tokens"])] for name, r in rows]
    engine = [r for name, r in rows if name.startswith("engine")]
    for name, a in [(n, r) for n, r in rows if n.startswith("http")] if engine else []:
        b = engine[0]
        table.append([f"{name} / engine", f"{_ratio(a['req_per_s'], b['req_per_s'])}x",
                      f"{_ratio(a['tok_per_s'], b['tok_per_s'])}x",
                      "/".join(f"{a['ttft'][p] / b['ttft'][p]:.2f}" for p in ("p50", "p90", "p99")),
                      "/".join(f"{a['itl'][p] / b['itl'][p]:.2f}" for p in ("p50", "p90", "p99")),
                      "/".join(f"{a['e2e'][p] / b['e2e'][p]:.2f}" for p in ("p50", "p90", "p99")), "", "", ""])
    widths = [max(len(str(r[i])) for r in [head] + table) for i in range(len(head))]
    line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    sys.path.insert(0, HERE)
    from timing import machine_line

    print(f"\n{machine_line()}")
    print(f"{args.concurrency} concurrent streaming clients, {args.max_tokens} new tokens per request "
          f"(EOS ignored), temperature {args.temperature}, dtype {args.dtype}, {args.duration:g} s or "
          f"{args.num_requests} requests per run (cut off = still running at the end; their tokens count)")
    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for r in table:
        print(line(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds per run (in-flight requests are then cut off)")
    ap.add_argument("--num-requests", type=int, default=128, help="at most this many requests per run")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process AsyncLLM run")
    ap.add_argument("--api-server-counts", default="1",
                    help="HTTP runs with these numbers of API servers, e.g. 1,2 (each starts a server)")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="engine-core replicas of the server")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--_engine-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._engine_only:
        print(json.dumps(run_engine(args)))
        return
    rows = []
    for k in [int(x) for x in args.api_server_counts.split(",")] if not args.url else [0]:
        server = None if args.url else start_server(args, k)
        url = args.url or server.url
        try:
            print(f"[serve-bench] http run against {url} ...", file=sys.stderr, flush=True)
            name = "http (rollout serve)" if k <= 1 else f"http, {k} API servers"
            rows.append((name, asyncio.run(run_http(url, args.api_key, questions(), args))))
        finally:
            if server is not None:
                server.stop()
    if not args.no_engine:
        print("[serve-bench] engine run (AsyncLLM in process) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--_engine-only"] + [a for a in sys.argv[1:] if a != "--_engine-only"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
        if out.returncode != 0:
            sys.exit(f"the engine run failed:\n{out.stderr[-3000:]}")
        rows.append(("engine (AsyncLLM, no HTTP)", json.loads(out.stdout.strip().splitlines()[-1])))
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows), f, indent=2)


if __name__ == "__main__":
    main()
