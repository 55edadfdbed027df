"""One synchronous GRPO step, part by part: what the rollout service saves a trainer per step.

The step of recipes/grpo_arithmetic.py (the default model learns 2-digit addition): sample
PROMPTS x GROUP answers, recompute their logprobs with the trainer's float32 copy, one GRPO
update, then hand the new weights to the sampler. Measured two ways in one run, on the same
problems, seeds and trainer:

  ours          `rollout serve` (float32, its own process) driven by the trainer client:
                `client.generate` (token ids + logprobs), `push_weights_shared` (pause, push
                through shared memory, swap, version, resume: one call; "paused" is how long
                generation stood still)
  transformers  the same loop on transformers alone: a second float32 copy of the model samples
                with `generate()` (logprobs from its scores), and the new weights are
                `load_state_dict` into it

Each part's time is the median over --steps steps after one warm-up step. Rewards differ between
the two (different samplers), the work per step does not (same prompts, same counts; EOS stops
both).

    python benchmarks/rl_step.py                    # ~2-3 minutes on 2 cores
    python benchmarks/rl_step.py --steps 5 --prompts 8 --group 8 --max-tokens 16
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from recipes.common import (arithmetic_problem, arithmetic_reward, group_advantages, grpo_loss,  # noqa: E402
                            load_policy, token_logprobs)
from rollout.client import RolloutClient  # noqa: E402
from rollout.subprocess_server import served  # noqa: E402
from timing import machine_line  # noqa: E402  (benchmarks/timing.py)

PARTS = ("rollout", "recompute", "train", "push", "step")


def train(model, opt, batch: dict, group: int) -> None:
    """Recompute (timed apart) and one GRPO update, as the recipe does."""
    t0 = time.perf_counter()
    with torch.no_grad():
        token_logprobs(model, batch["seqs"], batch["scored"])  # the recompute a trainer does to check pi_old
    batch["recompute"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adv = torch.repeat_interleave(group_advantages(batch["rewards"], group), torch.tensor(batch["lengths"]))
    new_lp = token_logprobs(model, batch["seqs"], batch["scored"])
    loss, _ = grpo_loss(new_lp, torch.tensor(batch["rollout_lp"]), adv)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    batch["train"] = time.perf_counter() - t0


def new_batch() -> dict:
    return {"seqs": [], "scored": [], "rewards": [], "lengths": [], "rollout_lp": []}


def add_sample(batch: dict, prompt: list[int], ids: list[int], logprobs: list[float], reward: float) -> None:
    batch["seqs"].append(prompt + ids)
    batch["scored"].append([False] * len(prompt) + [True] * len(ids))
    batch["rewards"].append(reward)
    batch["lengths"].append(len(ids))
    batch["rollout_lp"] += logprobs


def ours_rollout(client: RolloutClient, problems, prompts, args, seed: int) -> dict:
    t0 = time.perf_counter()
    outs = client.generate(prompts, {"n": args.group, "temperature": 1.0, "max_tokens": args.max_tokens,
                                     "logprobs": 0, "seed": seed})
    batch = new_batch()
    batch["rollout"] = time.perf_counter() - t0
    for (_, answer), prompt, samples in zip(problems, prompts, outs):
        for o in samples:
            add_sample(batch, prompt, o.token_ids, o.logprobs, arithmetic_reward(o.text, answer))
    return batch


def hf_rollout(sampler, tokenizer, problems, prompts, args, seed: int) -> dict:
    """transformers' generate() on a left-padded batch of every prompt repeated GROUP times."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(args.group)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = sampler.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, max_new_tokens=args.max_tokens, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=pad)
    new = out.sequences[:, width:]
    logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (rows, steps, V)
    chosen = logprobs.gather(-1, new[..., None])[..., 0]
    batch = new_batch()
    batch["rollout"] = time.perf_counter() - t0
    for r, prompt in enumerate(rows):
        n = len(new[r])
        eos = (new[r] == tokenizer.eos_token_id).nonzero()
        if len(eos):
            n = int(eos[0]) + 1
        answer = problems[r // args.group][1]
        token_ids = new[r, :n].tolist()
        add_sample(batch, prompt, token_ids, chosen[r, :n].tolist(),
                   arithmetic_reward(tokenizer.decode(token_ids, skip_special_tokens=True), answer))
    return batch


def run_ours(args, problems_by_step, model_path: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as log_dir, \
            served("--dtype", "float32", "--max-model-len", "512", log_path=Path(log_dir) / "server.log") as server, \
            RolloutClient(server.url, timeout=600) as client:
        client.wait_until_ready(300)
        model = load_policy(model_path)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        for step, problems in enumerate(problems_by_step):
            t_step = time.perf_counter()
            prompts = [client.tokenize(messages=m) for m, _ in problems]
            batch = ours_rollout(client, problems, prompts, args, seed=step)
            train(model, opt, batch, args.group)
            t0 = time.perf_counter()
            push = client.push_weights_shared(model.named_parameters())
            batch["push"], batch["paused"] = time.perf_counter() - t0, push["paused_seconds"] or 0.0
            batch["step"] = time.perf_counter() - t_step
            rows.append(batch)
            print(f"  ours step {step}: {batch['step']:.2f} s", flush=True)
    return rows


def run_hf(args, problems_by_step, model_path: str) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model, sampler = load_policy(model_path), load_policy(model_path).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rows = []
    for step, problems in enumerate(problems_by_step):
        t_step = time.perf_counter()
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for m, _ in problems]
        batch = hf_rollout(sampler, tokenizer, problems, prompts, args, seed=step)
        train(model, opt, batch, args.group)
        t0 = time.perf_counter()
        sampler.load_state_dict(model.state_dict())
        batch["push"], batch["paused"] = time.perf_counter() - t0, None
        batch["step"] = time.perf_counter() - t_step
        rows.append(batch)
        print(f"  transformers step {step}: {batch['step']:.2f} s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    from engine.default_model import resolve_model

    model_path = resolve_model(None)
    torch.manual_seed(0)
    rng = random.Random(0)
    problems_by_step = [[arithmetic_problem(rng) for _ in range(args.prompts)] for _ in range(args.steps + 1)]
    print(f"{machine_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print(f"GRPO step: {args.prompts} prompts x {args.group} samples x <= {args.max_tokens} tokens, float32, "
          f"median of {args.steps} steps after a warm-up", flush=True)
    results = {"ours": run_ours(args, problems_by_step, model_path)[1:],
               "transformers": run_hf(args, problems_by_step, model_path)[1:]}

    def median(name, part):
        values = [r[part] for r in results[name] if r.get(part) is not None]
        return statistics.median(values) if values else None

    print()
    print("| part | ours s | transformers s | ours faster |")
    print("|---|--:|--:|--:|")
    for part in PARTS:
        ours, hf = median("ours", part), median("transformers", part)
        print(f"| {part} | {ours:.3f} | {hf:.3f} | {hf / ours:.2f}x |")
    paused = median("ours", "paused")
    print(f"\nours: generation stood still {paused:.3f} s per push (pause -> push -> resume); "
          f"samples per step {len(results['ours'][0]['rewards'])}, tokens "
          f"{sum(results['ours'][0]['lengths'])} (ours) / {sum(results['transformers'][0]['lengths'])} "
          "(transformers) in the first measured step")


if __name__ == "__main__":
    main()
