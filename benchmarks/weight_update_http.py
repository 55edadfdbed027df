"""The trainer's weight update over HTTP, route by route, against a real `rollout serve` (the
default model) with this process as the trainer: what `client.push_weights` and its siblings
cost end to end (pause -> push -> swap -> cache reset -> resume, HTTP included), best of --reps
rounds (the routes take turns in every round; one round of warm-up first).

    push_weights         one POST /weights/update beside WeightSender.send (gloo, rank 0; asked
                         for: to a server on this machine push_weights takes push_weights_shared's
                         route by itself)
    vllm phases          the same push in vLLM's calls: /pause, /start_weight_update,
                         /update_weights beside the send, /finish_weight_update, /resume
                         (`with client.weight_update() as u: u.send(...)`)
    push_weights_shared  shared memory (a trainer on this machine), POST /weights/update
    push_weights_from_disk  the checkpoint the server started from, POST /weights/update

A request streams while every push runs (pause mode "keep" freezes it), so the pause and
resume do real work; "paused s" is how long generation stood still (the resume's answer, best
round). The server's own phase times (the answer's `phases`, of the best round)
are printed for the /weights/update routes. Times on a shared 2-core CPU are noisy: compare rows of one run.

    python benchmarks/weight_update_http.py            # --quick: float32, 3 rounds (~1 minute)
    python benchmarks/weight_update_http.py --reps 10  # for a comparison that outlasts this box's noise
    python benchmarks/weight_update_http.py --dtype bfloat16 --reps 5
"""
import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from rollout.client import RolloutAPIError, RolloutClient  # noqa: E402
from rollout.subprocess_server import served  # noqa: E402
from weight_sync import load_safetensors_folder  # noqa: E402


def _stream_forever(url: str, stop: threading.Event) -> None:
    """Keep one request generating, so that every pause has a request to freeze."""
    with RolloutClient(url, timeout=600) as c:
        while not stop.is_set():
            for _ in c.generate_stream([1, 2, 3], {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True}):
                if stop.is_set():
                    break


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the defaults: float32, 3 reps")
    args = ap.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"dtype {args.dtype}, best of {args.reps}")
    with tempfile.NamedTemporaryFile(prefix="weight-update-http-", suffix=".log", delete=False) as f:
        log = f.name
    with served("--dtype", args.dtype, log_path=log) as server, RolloutClient(server.url, timeout=600) as client:
        path = client.server_info()["model_path"]
        state = [(n, t.to(getattr(torch, args.dtype))) for n, t in load_safetensors_folder(path)]
        gb = sum(t.numel() * t.element_size() for _, t in state) / 1e9
        client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=120)
        stop = threading.Event()
        streamer = threading.Thread(target=_stream_forever, args=(server.url, stop), daemon=True)
        streamer.start()
        time.sleep(2.0)

        def vllm_phases():
            with client.weight_update() as u:
                u.send(state)
            return {"paused_seconds": u.paused_seconds}

        routes = {"push_weights": lambda: client.push_weights(state), "vllm phases": vllm_phases,
                  "push_weights_shared": lambda: client.push_weights_shared(state),
                  "push_weights_from_disk": lambda: client.push_weights_from_disk(path)}
        times, phases, paused, refused = {name: [] for name in routes}, {}, {name: [] for name in routes}, {}
        for rep in range(args.reps + 1):  # round robin, so that the box's drifting load hits every route alike
            for name, fn in routes.items():
                if name in refused:
                    continue
                t0 = time.perf_counter()
                try:
                    result = fn()
                except RolloutAPIError as e:  # (an older client's route that refuses to run beside requests)
                    refused[name] = f"refused: {e}"
                    continue
                if rep:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
                    if (result or {}).get("paused_seconds") is not None:
                        paused[name].append(result["paused_seconds"])
                    if times[name][-1] == min(times[name]):
                        phases[name] = (result or {}).get("phases")
        rows = [(name, None, None, None, refused[name]) if name in refused else
                (name, min(times[name]), statistics.median(times[name]), min(paused[name], default=None),
                 phases.get(name)) for name in routes]
        stop.set()
        client.close_weight_transfer()
    print("\n| route                   | best s | median s | GB/s | paused s | server phases (best round) |")
    print("|-------------------------|-------:|---------:|-----:|---------:|----------------------------|")
    for name, best, median, stood, detail in rows:
        if best is None:
            print(f"| {name:23s} |      - |        - |    - |        - | {detail[:100]} |")
            continue
        shown = ", ".join(f"{k} {v:.3f}" for k, v in detail.items()) if detail else ""
        stood = "       -" if stood is None else f"{stood:8.3f}"
        print(f"| {name:23s} | {best:6.3f} | {median:8.3f} | {gb / best:4.2f} | {stood} | {shown} |")
    print(f"\n{gb:.2f} GB per push; server log: {log}")


if __name__ == "__main__":
    main()
