"""Synchronous GRPO through the rollout service: the default model (SmolLM2-135M-Instruct) learns
2-digit addition answered as "Answer: N", rewarded by a regex and an integer comparison.

    .venv/bin/python recipes/grpo_arithmetic.py                 # starts `rollout serve` itself
    .venv/bin/python recipes/grpo_arithmetic.py --url http://127.0.0.1:8000 --steps 10
    .venv/bin/python recipes/grpo_arithmetic.py --device cuda --model FOLDER --steps 3   # one GPU

Every step: PROMPTS problems x GROUP answers sampled through the client (token ids, logprobs and
weight versions back), rewarded, the logprobs recomputed by the trainer's own float32 copy of the
model (their gap to the rollout's is logged: the rollout and the trainer must agree), one GRPO
update, then the new weights pushed (client.push_weights: pause in keep mode, send through shared
memory to a server on this machine or over the gloo group, atomic swap, resume), version = the
step. The run folder (runs/grpo_arithmetic-<time>/) gets history.jsonl, curves.png and the
trainer's and the server's offline W&B runs; `rollout dashboard <run folder>` draws both.

--batch-invariant serves in batch-invariant mode and recomputes every step's rollout logprobs with
engine.model.batch_invariant.InvariantScorer on the trainer's weights: `exact/mismatch_max` must be 0.0
(the sampler's logprobs are the trainer's pi_old bit for bit, whatever the batching).

--device cuda: the server (started here, its KV cache 2 GiB) and the trainer share one GPU, and
each push goes by CUDA IPC (client.push_weights_shared: the server reads the trainer's tensors in
place); with --url the server must be on this machine's GPU. --device cpu (the default) starts
the server on the CPU.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.common import (RunLog, arithmetic_problem, arithmetic_reward, group_advantages, grpo_loss,  # noqa: E402
                            new_run_dir, recipe_parser, rollout_server, start_trainer, token_logprobs)
from rollout.client import RolloutClient  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = recipe_parser(__doc__, steps=30, prompts=8, max_tokens=10, max_tokens_help="tokens sampled per answer")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a KL penalty to the initial policy")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio: [1 - clip, 1 + clip]")
    ap.add_argument("--eval-every", type=int, default=5, help="greedy reward on held-out problems every N steps")
    ap.add_argument("--eval-problems", type=int, default=64, help="held-out problems of that greedy reward")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="serve batch-invariant and check the rollout logprobs bit for bit against the trainer's "
                         "InvariantScorer recompute (exact/mismatch_max)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the server started here and the trainer run; cuda: one GPU for both, pushes by "
                         "CUDA IPC")
    ap.add_argument("--model", default=None,
                    help="a Hugging Face folder for the server started here (default: the default model; with "
                         "--url the trainer loads what that server serves)")
    args = ap.parse_args(argv)
    if args.url and args.model:
        ap.error("--model names the model of the server started here: not with --url")
    if args.batch_invariant and args.device == "cuda":
        ap.error("--batch-invariant is float32 on the CPU: not with --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return args


def rollout_batch(client: RolloutClient, rng: random.Random, args, seed: int, extra_params: dict | None = None
                  ) -> dict:
    """Sample, score and flatten one step's rollouts. `extra_params`: more sampling params (grpo_async's
    max_weight_staleness); a group with a sample the server ended as "stale" is left out whole (its
    advantages need every sample), counted in "stale" (samples) and "stale_groups"."""
    problems = [arithmetic_problem(rng) for _ in range(args.prompts)]
    prompts = [client.tokenize(messages=messages) for messages, _ in problems]
    t0 = time.perf_counter()
    outs = client.generate(prompts, {"n": args.group, "temperature": 1.0, "max_tokens": args.max_tokens,
                                     "logprobs": 0, "seed": seed, **(extra_params or {})})
    seconds = time.perf_counter() - t0
    batch = {"seqs": [], "scored": [], "rewards": [], "lengths": [], "rollout_lp": [], "versions": [], "stale": 0,
             "stale_groups": 0}
    for (_, answer), prompt, samples in zip(problems, prompts, outs):
        num_stale = sum(o.finish_reason == "stale" for o in samples)
        if num_stale:
            batch["stale"] += num_stale
            batch["stale_groups"] += 1
            continue
        for o in samples:
            batch["seqs"].append(prompt + o.token_ids)
            batch["scored"].append([False] * len(prompt) + [True] * len(o.token_ids))
            batch["rewards"].append(arithmetic_reward(o.text, answer))
            batch["lengths"].append(len(o.token_ids))
            batch["rollout_lp"] += o.logprobs
            batch["versions"] += o.weight_versions
    batch["seconds"] = seconds
    return batch


def evaluate(client: RolloutClient, problems: list[tuple[list[dict], int]]) -> dict:
    """Greedy answers to a fixed set of held-out problems: the curve that says whether it learned."""
    prompts = [client.tokenize(messages=messages) for messages, _ in problems]
    outs = client.generate(prompts, {"temperature": 0.0, "max_tokens": 10})
    rewards = [arithmetic_reward(o.text, answer) for o, (_, answer) in zip(outs, problems)]
    return {"eval/reward": sum(rewards) / len(rewards), "eval/solved": sum(r == 1.0 for r in rewards) / len(rewards)}


def train_step(model, opt, ref, batch: dict, args, prox_lp: torch.Tensor | None = None) -> tuple[float, object]:
    """One GRPO update on a batch; returns (seconds, LossStats)."""
    t0 = time.perf_counter()
    adv_seq = group_advantages(batch["rewards"], args.group)
    device = next(model.parameters()).device
    adv = torch.repeat_interleave(adv_seq, torch.tensor(batch["lengths"])).to(device)
    rollout_lp = torch.tensor(batch["rollout_lp"], device=device)
    ref_lp = None
    if ref is not None:
        with torch.no_grad():
            ref_lp = token_logprobs(ref, batch["seqs"], batch["scored"])
    new_lp = token_logprobs(model, batch["seqs"], batch["scored"])
    loss, stats = grpo_loss(new_lp, rollout_lp, adv, ref_lp, prox_lp, clip=args.clip, kl_coef=args.kl_coef)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0, stats


def exact_mismatch(scorer, model, batch: dict) -> dict:
    """The rollout's logprobs against the batch-invariant recompute on the weights that sampled
    them (the trainer's, pushed last step): 0.0 unless something is broken."""
    scorer.load_state_dict(model.state_dict())
    lps = scorer.token_logprobs(batch["seqs"])
    exact = torch.cat([lp[torch.tensor(mask[1:])] for lp, mask in zip(lps, batch["scored"])])
    gap = (exact - torch.tensor(batch["rollout_lp"])).abs()
    return {"exact/mismatch_max": gap.max().item(), "exact/tokens_differing": int((gap > 0).sum())}


def reward_row(batch: dict) -> dict:
    r = torch.tensor(batch["rewards"])
    return {"reward/mean": r.mean().item(), "reward/std": r.std().item(),
            "reward/solved": (r == 1.0).float().mean().item(),
            "rollout/seconds": batch["seconds"],
            "rollout/tokens_per_s": sum(batch["lengths"]) / max(batch["seconds"], 1e-9)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    run_dir = new_run_dir("grpo_arithmetic", args.run_root)
    serve_args = ["--max-model-len", "512", "--device", args.device]
    if args.batch_invariant:
        serve_args.append("--batch-invariant")
    if args.device == "cuda":  # (not what --gpu-memory-utilization leaves: the trainer needs the GPU too)
        serve_args += ["--kv-cache-memory", "2GiB"]
    if args.model:
        serve_args += ["--model", args.model]
    with rollout_server(args.url, run_dir, *serve_args) as url, RolloutClient(url, timeout=600) as client:
        client.wait_until_ready(300)
        model, ref, opt, version, model_path = start_trainer(client, args.lr, args.kl_coef, args.device)
        # CPU: gloo group (shared memory to a CPU server on this machine); CUDA: IPC on the shared GPU
        push_weights = client.push_weights if args.device == "cpu" else client.push_weights_shared
        scorer = None
        if args.batch_invariant:
            from engine.model.batch_invariant import InvariantScorer

            scorer = InvariantScorer(model_path, max_model_len=512)
        log = RunLog(run_dir, run_dir.name, dict(vars(args), recipe="grpo_arithmetic", model=model_path))
        print(f"[recipe] {run_dir}: {args.steps} steps of {args.prompts} x {args.group} rollouts", flush=True)
        held_out = [arithmetic_problem(random.Random(f"eval-{i}")) for i in range(args.eval_problems)]
        first_eval = evaluate(client, held_out)
        log.log(0, first_eval)
        print(f"[recipe] held-out greedy reward before training: {first_eval['eval/reward']:.3f}", flush=True)
        t_start = time.perf_counter()
        rows = []
        for step in range(1, args.steps + 1):
            t_step = time.perf_counter()
            batch = rollout_batch(client, rng, args, seed=args.seed * 100_003 + step)
            exact = exact_mismatch(scorer, model, batch) if scorer is not None else {}
            train_s, stats = train_step(model, opt, ref, batch, args)
            t_push = time.perf_counter()
            push = push_weights(model.named_parameters(), version=version + step)
            push_s = time.perf_counter() - t_push  # (the trainer's wait; push_weights_shared's "seconds": the server's)
            row = dict(reward_row(batch), **{
                "mismatch/mean": stats.mismatch_mean, "mismatch/max": stats.mismatch_max,
                "ratio/std": stats.ratio_std, "ratio/max": stats.ratio_max, "kl": stats.kl,
                "clipped": stats.clipped, "train/seconds": train_s, "push/seconds": push_s,
                "push/paused_seconds": push["paused_seconds"] or 0.0, "weight_version": push["weight_version"],
                "staleness/mean": sum(push["weight_version"] - 1 - v for v in batch["versions"]) / len(
                    batch["versions"]),
                "staleness/max": max(push["weight_version"] - 1 - v for v in batch["versions"]),
                "wall_seconds": time.perf_counter() - t_start, "step/seconds": time.perf_counter() - t_step}, **exact)
            if step % args.eval_every == 0 or step == args.steps:
                row.update(evaluate(client, held_out))
            rows.append(row)
            log.log(step, row)
            print(f"[recipe] step {step:3d}  reward {row['reward/mean']:.3f} (solved {row['reward/solved']:.2f})  "
                  f"mismatch {stats.mismatch_mean:.1e}  rollout {batch['seconds']:.1f}s  train {train_s:.1f}s  "
                  f"push {push_s:.2f}s  step {row['step/seconds']:.1f}s  v{push['weight_version']}"
                  + (f"  held-out {row['eval/reward']:.3f}" if "eval/reward" in row else "")
                  + (f"  exact mismatch {exact['exact/mismatch_max']:.1e}" if exact else ""), flush=True)
        client.close_weight_transfer()
        png = log.finish()
    print(f"[recipe] done in {time.perf_counter() - t_start:.0f} s ({args.device}): {png}", flush=True)
    if rows:  # (rollout + train + push, the held-out evaluation left out)
        later = [r["step/seconds"] for r in rows[1:]]  # (the first step warms up)
        print(f"[recipe] seconds per step: first {rows[0]['step/seconds']:.2f}"
              + (f", then {sum(later) / len(later):.2f} on average" if later else ""), flush=True)
    return {"run_dir": run_dir, "rows": rows, "start_version": version, "png": png, "first_eval": first_eval}


if __name__ == "__main__":
    main()
