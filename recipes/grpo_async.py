"""Asynchronous GRPO: rollouts keep running while the trainer trains. The task, reward and loss are
grpo_arithmetic's; what changes:

- a rollout thread samples the next batch while the trainer trains on the current one (at most
  --ahead batches ahead);
- pushes pause in mode keep: requests in flight freeze, take the new weights and go on, so one
  sequence's tokens may come from several versions (each token carries its version);
- off-policy correction: the loss's ratio is against the trainer's policy before the update
  (recomputed), times a truncated importance weight min(pi_trainer / pi_rollout, --is-cap) per
  token from the rollout's logprobs;
- staleness is the server's to enforce: every request carries max_weight_staleness=--max-staleness,
  so a push that leaves a sample's oldest token more than that many versions behind the live
  weights ends it there (finish_reason "stale", its KV freed at once); its group is dropped (GRPO
  needs whole groups), a batch left with none is skipped. A finished batch waiting for the trainer
  ages by at most --ahead more versions: staleness/mean and staleness/max log the age at training;
- each step asks the server to recompute one rollout sampled wholly under its live weights
  (POST /logprobs/compare) and logs the largest difference from the logprobs it sampled with
  (consistency/max_abs_diff: rounding-sized unless the server's forward is broken); pushes go
  through the server's one transactional update call (client.push_weights).

    .venv/bin/python recipes/grpo_async.py                  # async only
    .venv/bin/python recipes/grpo_async.py --compare-sync   # the synchronous recipe first, same
                                                           # settings, then a wall-time table
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes import grpo_arithmetic  # noqa: E402
from recipes.common import (RunLog, new_run_dir, recipe_parser, rollout_server, start_trainer,  # noqa: E402
                            token_logprobs)
from rollout.client import RolloutAPIError, RolloutClient  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = recipe_parser(__doc__, steps=30, prompts=8, max_tokens=10, max_tokens_help="tokens sampled per answer")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a KL penalty to the initial policy")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio: [1 - clip, 1 + clip]")
    ap.add_argument("--is-cap", type=float, default=2.0, help="truncation of the per-token importance weight")
    ap.add_argument("--max-staleness", type=int, default=2,
                    help="the server ends a sample whose oldest token is more than this many versions behind the "
                         "live weights (max_weight_staleness); its group is dropped")
    ap.add_argument("--ahead", type=int, default=1, help="batches the rollouts may run ahead of the trainer")
    ap.add_argument("--compare-sync", action="store_true",
                    help="run grpo_arithmetic with the same settings first and print both wall times")
    return ap.parse_args(argv)


class Rollouts(threading.Thread):
    """Samples batches with its own client until stopped. A batch starts only when one of `ahead`
    slots is free (the trainer took an earlier batch), so with ahead=1 the next batch samples
    while the trainer trains on the current one: its tokens are at most one version stale."""

    def __init__(self, url: str, args, rng: random.Random):
        super().__init__(daemon=True)
        self.url, self.args, self.rng = url, args, rng
        self.batches: queue.Queue = queue.Queue()
        self.slots = threading.Semaphore(args.ahead)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with RolloutClient(self.url, timeout=600) as client:
                n = 0
                while not self.stopping.is_set():
                    if not self.slots.acquire(timeout=0.2):
                        continue
                    n += 1
                    self.batches.put(grpo_arithmetic.rollout_batch(
                        client, self.rng, self.args, self.args.seed * 100_003 + n,
                        {"max_weight_staleness": self.args.max_staleness}))
        except BaseException as e:  # noqa: BLE001 - the trainer re-raises it
            self.error = e
            self.stopping.set()

    def next(self) -> dict:
        """The next batch (its slot is freed: the following batch starts sampling now)."""
        while True:
            if self.error is not None:
                raise RuntimeError("the rollout thread failed") from self.error
            try:
                batch = self.batches.get(timeout=0.5)
            except queue.Empty:
                continue
            self.slots.release()
            return batch


def main(argv=None) -> dict:
    args = parse_args(argv)
    sync = None
    if args.compare_sync:
        # the same settings; no held-out passes inside the timed loop (async has none either)
        sync_argv = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                     "--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--kl-coef", str(args.kl_coef),
                     "--seed", str(args.seed), "--eval-every", str(10**6)]
        sync_argv += ["--url", args.url] if args.url else []
        sync_argv += ["--run-root", args.run_root] if args.run_root else []
        sync = grpo_arithmetic.main(sync_argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    run_dir = new_run_dir("grpo_async", args.run_root)
    # rollouts and training run at the same time: on a CPU they split the cores instead of both
    # spinning threads on all of them (a server given by --url keeps its own setting)
    cores = os.cpu_count() or 2
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cores - cores // 2))
    with rollout_server(args.url, run_dir, "--max-model-len", "512", "--num-threads", str(max(1, cores // 2))) as url, \
            RolloutClient(url, timeout=600) as client:
        client.wait_until_ready(300)
        model, ref, opt, version, model_path = start_trainer(client, args.lr, args.kl_coef)
        start_version = version
        log = RunLog(run_dir, run_dir.name, dict(vars(args), recipe="grpo_async", model=model_path))
        print(f"[recipe] {run_dir}: {args.steps} async steps of {args.prompts} x {args.group} rollouts", flush=True)
        t_start = time.perf_counter()
        rollouts = Rollouts(url, args, rng)
        rollouts.start()
        rows, dropped, dropped_groups, num_stale = [], 0, 0, 0
        try:
            step = 0
            while step < args.steps:
                batch = rollouts.next()
                num_stale += batch["stale"]
                dropped_groups += batch["stale_groups"]
                if not batch["seqs"]:  # every group had a sample the server ended as stale
                    dropped += 1
                    continue
                staleness = [version - v for v in batch["versions"]]
                consistency = server_consistency(client, batch, version)
                step += 1
                with torch.no_grad():  # the trainer's policy before this update: the ratio's anchor
                    prox_lp = token_logprobs(model, batch["seqs"], batch["scored"])
                train_s, stats = grpo_arithmetic.train_step(model, opt, ref, batch, args, prox_lp)
                push = client.push_weights(model.named_parameters(), version=start_version + step)
                version = push["weight_version"]
                row = dict(grpo_arithmetic.reward_row(batch), **{
                    "mismatch/mean": stats.mismatch_mean, "mismatch/max": stats.mismatch_max,
                    "ratio/std": stats.ratio_std, "ratio/max": stats.ratio_max, "kl": stats.kl,
                    "clipped": stats.clipped, "train/seconds": train_s, "push/seconds": push["seconds"],
                    "push/paused_seconds": push["paused_seconds"] or 0.0, "push/kept": push["kept"],
                    "weight_version": version, "staleness/mean": sum(staleness) / len(staleness),
                    "staleness/max": max(staleness), "staleness/within_max": within_request_spread(batch),
                    "stale/samples": num_stale, "dropped_groups": dropped_groups, "dropped_batches": dropped,
                    "wall_seconds": time.perf_counter() - t_start})
                if consistency is not None:
                    row["consistency/max_abs_diff"] = consistency
                rows.append(row)
                log.log(step, row)
                print(f"[recipe] step {step:3d}  reward {row['reward/mean']:.3f} (solved {row['reward/solved']:.2f})"
                      f"  staleness {row['staleness/mean']:.2f}/{max(staleness)} (stale {num_stale})  mismatch "
                      f"{stats.mismatch_mean:.1e}  train {train_s:.1f}s  push {push['seconds']:.1f}s  v{version}",
                      flush=True)
        finally:
            rollouts.stopping.set()
            rollouts.join(120)
        client.close_weight_transfer()
        png = log.finish()
    torch.set_num_threads(threads)
    print(f"[recipe] done in {time.perf_counter() - t_start:.0f} s: {png}", flush=True)
    result = {"run_dir": run_dir, "rows": rows, "png": png, "dropped": dropped, "dropped_groups": dropped_groups,
              "stale": num_stale}
    if sync is not None:
        result["comparison"] = compare(sync["rows"], rows)
    return result


def server_consistency(client: RolloutClient, batch: dict, version: int) -> float | None:
    """The server's recompute of the first rollout whose every token came from the live weights
    (`version`) against the logprobs it was sampled with: the largest difference, or None when no
    rollout qualifies or a push moved the weights meanwhile (409)."""
    start = 0
    for seq, scored, length in zip(batch["seqs"], batch["scored"], batch["lengths"]):
        versions = batch["versions"][start:start + length]
        if length and set(versions) == {version}:
            prompt = seq[:scored.index(True)]
            try:
                return client.compare_logprobs(prompt, seq[len(prompt):], batch["rollout_lp"][start:start + length],
                                               weight_version=version, temperature=1.0)["max_abs_diff"]
            except RolloutAPIError as e:
                if e.status != 409:
                    raise
                return None
        start += length
    return None


def within_request_spread(batch: dict) -> int:
    """The largest version span inside one kept sequence (newest - oldest token): the server keeps
    it at most --max-staleness."""
    spans, start = [], 0
    for n in batch["lengths"]:
        versions = batch["versions"][start:start + n]
        spans.append(max(versions) - min(versions) if versions else 0)
        start += n
    return max(spans, default=0)


def moving_average(values: list[float], window: int = 4) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def compare(sync_rows: list[dict], async_rows: list[dict]) -> dict:
    """Wall seconds until each run's 4-step moving-average reward first reaches the lower of the
    two runs' best moving averages (the same reward for both), printed as a table."""
    curves = {name: moving_average([r["reward/mean"] for r in rows])
              for name, rows in (("sync", sync_rows), ("async", async_rows))}
    target = min(max(c) for c in curves.values())
    table = {}
    for name, rows in (("sync", sync_rows), ("async", async_rows)):
        i = next(i for i, v in enumerate(curves[name]) if v >= target)
        table[name] = {"seconds_to_target": rows[i]["wall_seconds"], "steps_to_target": i + 1,
                       "total_seconds": rows[-1]["wall_seconds"], "final_reward_ma": curves[name][-1]}
    print(f"\n[recipe] wall time to a 4-step moving-average reward of {target:.3f}:")
    print(f"{'':8}{'seconds':>10}{'steps':>8}{'total s':>10}{'final MA':>10}")
    for name, t in table.items():
        print(f"{name:8}{t['seconds_to_target']:10.0f}{t['steps_to_target']:8d}{t['total_seconds']:10.0f}"
              f"{t['final_reward_ma']:10.3f}")
    return dict(table, target=target)


if __name__ == "__main__":
    main()
