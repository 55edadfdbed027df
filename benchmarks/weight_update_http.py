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

--data-parallel-size N (N replicas, local processes) measures what push_weights picks by itself
for a trainer on this machine instead, beside the group every replica would take:

    push_weights (spare)     every replica here: each one's leased spare written, one update
    1 replica elsewhere      the last replica as if on another machine (its /server_info host
                             rewritten, as a multi-node Ray cluster's reads): the group is formed
                             from its worker alone, the others' spares written beside the broadcast
    push_weights (group)     every replica in the group (shared_memory_when_local=False)

Each of these routes forms its own group before its turn (untimed: workers are in one group at a
time), after two warm-up rounds.

A request streams while every push runs (pause mode "keep" freezes it), so the pause and resume
do real work (--idle: none does); "paused s" is how long generation stood still (the resume's
answer, best round), "tok/s during" the tokens that request got per second of push (median):
where the server receives beside its steps it generates on through the transfer and stands still
for the swap only. The server's own phase times (the answer's `phases`, of the best round) are
printed for the /weights/update routes. Times on a shared 2-core CPU are noisy: compare rows of one run.

    python benchmarks/weight_update_http.py            # --quick: float32, 3 rounds (~1 minute)
    python benchmarks/weight_update_http.py --reps 10  # for a comparison that outlasts this box's noise
    python benchmarks/weight_update_http.py --dtype bfloat16 --reps 5
    python benchmarks/weight_update_http.py --data-parallel-size 2 --reps 5
    python benchmarks/weight_update_http.py --tensor-parallel-size 2 --reps 5
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from rollout.client import RolloutAPIError, RolloutClient  # noqa: E402
from rollout.subprocess_server import served  # noqa: E402
from timing import machine_line  # noqa: E402  (benchmarks/timing.py)
from weight_sync import load_safetensors_folder  # noqa: E402


def _stream_forever(url: str, stop: threading.Event, tokens: list[int]) -> None:
    """Keep one request generating, so that every pause has a request to freeze; tokens[0]
    counts the tokens it got."""
    with RolloutClient(url, timeout=600) as c:
        while not stop.is_set():
            for _, deltas in c.generate_stream([1, 2, 3], {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True}):
                tokens[0] += sum(len(d.token_ids) for d in deltas)
                if stop.is_set():
                    break


class LastReplicaElsewhere(RolloutClient):
    """A trainer that sees the server's last replica on another machine (the only rewrite: every
    byte still moves, through shared memory or over gloo)."""

    def server_info(self):
        info = super().server_info()
        hosts = dict(info["replica_hosts"])
        hosts[max(hosts, key=int)] = "another-machine"
        return dict(info, shm_host=None, replica_hosts=hosts)


def dp_routes(url: str, state: list) -> dict:
    """{route: (client, its init_weight_transfer kwargs, the push)} for --data-parallel-size."""
    here, grouped = RolloutClient(url, timeout=600), RolloutClient(url, timeout=600)
    elsewhere = LastReplicaElsewhere(url, timeout=600)
    return {"push_weights (spare)": (here, {}, lambda: here.push_weights(state)),
            "1 replica elsewhere": (elsewhere, {}, lambda: elsewhere.push_weights(state)),
            "push_weights (group)": (grouped, {"shared_memory_when_local": False}, lambda: grouped.push_weights(state))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the defaults: float32, 3 reps")
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--idle", action="store_true",
                    help="no request streams: the push alone (on 2 cores a streaming replica and the trainer's "
                         "writes share them)")
    args = ap.parse_args()
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    print(f"{machine_line()}; torch {torch.__version__}; dtype {args.dtype}, best of {args.reps}"
          + (f"; {dp} replicas" if dp > 1 else "") + (f"; {tp} tensor-parallel ranks" if tp > 1 else ""))
    with tempfile.NamedTemporaryFile(prefix="weight-update-http-", suffix=".log", delete=False) as f:
        log = f.name
    with served("--dtype", args.dtype, "--data-parallel-size", str(dp), "--tensor-parallel-size", str(tp),
                log_path=log) as server, \
            RolloutClient(server.url, timeout=600) as client:
        path = client.server_info()["model_path"]
        state = [(n, t.to(getattr(torch, args.dtype))) for n, t in load_safetensors_folder(path)]
        gb = sum(t.numel() * t.element_size() for _, t in state) / 1e9
        stop, streamed = threading.Event(), [0]
        if not args.idle:
            threading.Thread(target=_stream_forever, args=(server.url, stop, streamed), daemon=True).start()
            time.sleep(2.0)

        def vllm_phases():
            with client.weight_update() as u:
                u.send(state)
            return {"paused_seconds": u.paused_seconds}

        if dp > 1:
            routed = dp_routes(server.url, state)
        else:
            group = (client, {"shared_memory_when_local": False})
            routed = {"push_weights": (*group, lambda: client.push_weights(state)), "vllm phases": (*group, vllm_phases),
                      "push_weights_shared": (None, {}, lambda: client.push_weights_shared(state)),
                      "push_weights_from_disk": (None, {}, lambda: client.push_weights_from_disk(path))}
        times, phases, paused, refused = {name: [] for name in routed}, {}, {name: [] for name in routed}, {}
        beside = {name: [] for name in routed}  # tokens/s the streaming request got during each push
        transports, grouped = {}, None
        # Round robin, so that the box's drifting load hits every route alike; with replicas two
        # warm-up rounds (a spare alternates between two segments, whose pages the first writes fault)
        warm = 2 if dp > 1 else 1
        for rep, name in [(rep, name) for rep in range(args.reps + warm) for name in routed]:
            if name in refused:
                continue
            owner, init, fn = routed[name]
            if owner is not None and grouped is not owner:  # (untimed: the workers join its group)
                owner.init_weight_transfer(backend="gloo", timeout_s=120, **init)
                grouped = owner
            t0, n0 = time.perf_counter(), streamed[0]
            try:
                result = fn()
            except RolloutAPIError as e:  # (an older client's route that refuses to run beside requests)
                refused[name] = f"refused: {e}"
                continue
            if rep >= warm:
                times[name].append(time.perf_counter() - t0)
                beside[name].append((streamed[0] - n0) / times[name][-1])
                transports[name] = (result or {}).get("transport") or (result or {}).get("shared_via")
                if (result or {}).get("paused_seconds") is not None:
                    paused[name].append(result["paused_seconds"])
                if times[name][-1] == min(times[name]):
                    phases[name] = (result or {}).get("phases")
        rows = [(name, None, None, None, None, refused[name]) if name in refused else
                (name, min(times[name]), statistics.median(times[name]), min(paused[name], default=None),
                 None if args.idle else statistics.median(beside[name]), phases.get(name)) for name in routed]
        stop.set()
        for owner in {owner for owner, _, _ in routed.values() if owner is not None}:
            owner.close_weight_transfer()
            if owner is not client:
                owner.close()
    print("\n| route                   | transport     | best s | median s | GB/s | paused s | tok/s during "
          "| server phases (best round) |")
    print("|-------------------------|---------------|-------:|---------:|-----:|---------:|-------------:"
          "|----------------------------|")
    for name, best, median, stood, rate, detail in rows:
        if best is None:
            print(f"| {name:23s} | -             |      - |        - |    - |        - |            - "
                  f"| {detail[:100]} |")
            continue
        shown = ", ".join(f"{k} {v:.3f}" for k, v in detail.items()) if detail else ""
        stood = "       -" if stood is None else f"{stood:8.3f}"
        rate = "           -" if rate is None else f"{rate:12.1f}"
        print(f"| {name:23s} | {transports.get(name) or '-':13s} | {best:6.3f} | {median:8.3f} | {gb / best:4.2f} "
              f"| {stood} | {rate} | {shown} |")
    print(f"\n{gb:.2f} GB per push; server log: {log}")


if __name__ == "__main__":
    main()
