"""Multi-turn GRPO with a calculator tool: the model asks the tool in a fixed format
("CALL 47*6"), the environment answers as the next user message, the model answers
("Answer: 282"). The trainer scores only the tokens the model wrote (the tool's tokens are masked
out of the loss) and never re-tokenises text: it trains on exactly the token ids the engine ran
(asserted, and the trainer's recomputed logprobs match the rollout's).

    .venv/bin/python recipes/multiturn_tool.py                 # starts `rollout serve` itself
    .venv/bin/python recipes/multiturn_tool.py --url http://127.0.0.1:8000 --steps 5

Turn 1 samples until <|im_end|>; if it holds a call, turn 2 samples the answer. Two ways to
send turn 2 (--turns):
  prefix   (default) the whole conversation as chat messages plus `prefix_token_ids`, the exact
           ids of turn 1 (prompt + completion): the server keeps them and adds the template's ids
           for the tool's message only; where the template would have tokenised turn 1
           differently it says so (retokenization_drift, logged as tool/drift_turns).
  session  one HTTP session per rollout (client.session()): the tool's answer goes in as token
           ids the recipe renders itself, and the engine keeps the session's KV between turns
           (asserted: the session's token count on the server equals the trainer's).
All rollouts of a step run concurrently (AsyncRolloutClient), so the engine batches their turns.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.common import (RunLog, arithmetic_reward, group_advantages, grpo_loss, new_run_dir,  # noqa: E402
                            recipe_parser, rollout_server, start_trainer, token_logprobs)
from rollout.client import AsyncRolloutClient, RolloutClient  # noqa: E402

SYSTEM = "You can use a calculator: write CALL followed by the product, then give the answer."
EXAMPLE = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "What is 23 * 7?"},
           {"role": "assistant", "content": "CALL 23*7"},
           {"role": "user", "content": "Result: 161"},
           {"role": "assistant", "content": "Answer: 161"}]
CALL = re.compile(r"CALL\s*(\d+)\s*\*\s*(\d+)")


def problem(rng: random.Random) -> tuple[list[dict], int]:
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    return EXAMPLE + [{"role": "user", "content": f"What is {a} * {b}?"}], a * b


def tool_reply(text: str) -> str | None:
    """The calculator's answer to a call in `text`, or None when there is no call."""
    m = CALL.search(text)
    if m is None:
        return None
    return f"Result: {int(m.group(1)) * int(m.group(2))}"


async def prefix_rollout(client: AsyncRolloutClient, messages: list[dict], prompt: list[int], answer: int,
                         params: dict) -> dict:
    """A turn, maybe a tool call and a second turn sent as chat messages with turn 1's exact ids
    as prefix_token_ids. Returns what session_rollout returns, and whether the template drifted."""
    [out] = await client.generate(prompt, params)
    seq, scored = prompt + out.token_ids, [False] * len(prompt) + [True] * len(out.token_ids)
    logprobs, versions = list(out.logprobs), list(out.weight_versions)
    text, drift, reply = out.text, False, tool_reply(out.text)
    if reply is not None:
        convo = messages + [{"role": "assistant", "content": out.text}, {"role": "user", "content": reply}]
        out = await client.generate_chat(convo, params, prefix_token_ids=seq)
        # token in, token out: turn 1's ids are the prompt's start, whatever the template makes of them
        assert out.prompt_token_ids[:len(seq)] == seq, "the server re-tokenised turn 1"
        added = len(out.prompt_token_ids) - len(seq)  # the turn's closing "\n" and the tool's message
        seq = out.prompt_token_ids + out.token_ids
        scored += [False] * added + [True] * len(out.token_ids)
        logprobs += out.logprobs
        versions += out.weight_versions
        text, drift = out.text, out.retokenization_drift is not None
    return {"seq": seq, "scored": scored, "rollout_lp": logprobs, "versions": versions,
            "reward": arithmetic_reward(text, answer), "called": reply is not None, "drift": drift}


async def session_rollout(client: AsyncRolloutClient, prompt: list[int], answer: int, params: dict, eos: int,
                          tokens_of) -> dict:
    """One session: a turn, maybe a tool call and a second turn. Returns the conversation's token
    ids, which of them the model wrote, their rollout logprobs and versions, and the reward."""
    async with await client.session() as s:
        out = await s.generate(prompt, params)
        text = out.text
        reply = tool_reply(text)
        if reply is not None:
            close = "" if out.token_ids and out.token_ids[-1] == eos else "<|im_end|>"
            tool_ids = await tokens_of(f"{close}\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n")
            out = await s.generate(tool_ids, params)
            text = out.text
        listed = {x["session_id"]: x for x in await client.list_sessions()}
        # token in, token out: the server's conversation is exactly the one the trainer will score
        assert listed[s.id]["num_tokens"] == len(s.token_ids), "the session's tokens drifted from the trainer's"
        return {"seq": s.token_ids, "scored": s.generated, "rollout_lp": [lp for lp, g in zip(s.logprobs, s.generated)
                                                                          if g],
                "versions": [v for v, g in zip(s.weight_versions, s.generated) if g],
                "reward": arithmetic_reward(text, answer), "called": reply is not None, "drift": False}


async def rollout_batch(url: str, problems: list[tuple[list[dict], int]], prompts: list[list[int]], group: int,
                        params: dict, eos: int, turns: str = "prefix") -> list[dict]:
    async with AsyncRolloutClient(url, timeout=600) as client:
        cache: dict[str, list[int]] = {}

        async def tokens_of(text: str) -> list[int]:
            if text not in cache:
                cache[text] = await client.tokenize(prompt=text)
            return cache[text]

        def job(messages, prompt, answer, seed):
            sampling = dict(params, seed=seed)
            if turns == "prefix":
                return prefix_rollout(client, messages, prompt, answer, sampling)
            return session_rollout(client, prompt, answer, sampling, eos, tokens_of)

        jobs = [job(m, p, a, params["seed"] + i * group + j)
                for i, ((m, a), p) in enumerate(zip(problems, prompts)) for j in range(group)]
        return await asyncio.gather(*jobs)


def parse_args(argv=None) -> argparse.Namespace:
    ap = recipe_parser(__doc__, steps=20, prompts=4, max_tokens=12, max_tokens_help="tokens sampled per turn")
    ap.add_argument("--turns", choices=("prefix", "session"), default="prefix",
                    help="how turn 2 is sent: chat messages with turn 1's ids as prefix_token_ids, or an HTTP session")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    run_dir = new_run_dir("multiturn_tool", args.run_root)
    with rollout_server(args.url, run_dir, "--max-model-len", "512") as url, \
            RolloutClient(url, timeout=600) as client:
        client.wait_until_ready(300)
        model, _, opt, version, model_path = start_trainer(client, args.lr)
        eos = model.config.eos_token_id
        log = RunLog(run_dir, run_dir.name, dict(vars(args), recipe="multiturn_tool", model=model_path))
        t_start = time.perf_counter()
        rows = []
        for step in range(1, args.steps + 1):
            problems = [problem(rng) for _ in range(args.prompts)]
            prompts = [client.tokenize(messages=m) for m, _ in problems]
            params = {"temperature": 1.0, "max_tokens": args.max_tokens, "logprobs": 0,
                      "seed": args.seed * 100_003 + step * 1000}
            t0 = time.perf_counter()
            rollouts = asyncio.run(rollout_batch(url, problems, prompts, args.group, params, eos, args.turns))
            rollout_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            rewards = [r["reward"] for r in rollouts]
            adv_seq = group_advantages(rewards, args.group)
            lengths = torch.tensor([len(r["rollout_lp"]) for r in rollouts])
            adv = torch.repeat_interleave(adv_seq, lengths)
            rollout_lp = torch.tensor([lp for r in rollouts for lp in r["rollout_lp"]])
            # only the model's own tokens are scored: prompts and tool answers are context
            new_lp = token_logprobs(model, [r["seq"] for r in rollouts], [r["scored"] for r in rollouts])
            loss, stats = grpo_loss(new_lp, rollout_lp, adv)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            train_s = time.perf_counter() - t0
            push = client.push_weights(model.named_parameters(), version=version + step)
            versions = [v for r in rollouts for v in r["versions"]]
            r = torch.tensor(rewards)
            row = {"reward/mean": r.mean().item(), "reward/std": r.std().item(),
                   "reward/solved": (r == 1.0).float().mean().item(),
                   "tool/call_rate": sum(x["called"] for x in rollouts) / len(rollouts),
                   "tool/masked_tokens": sum(len(x["seq"]) - sum(x["scored"]) for x in rollouts),
                   # second turns whose turn-1 ids the chat template would have tokenised otherwise
                   "tool/drift_turns": sum(x["drift"] for x in rollouts),
                   "mismatch/mean": stats.mismatch_mean, "mismatch/max": stats.mismatch_max,
                   "ratio/std": stats.ratio_std, "ratio/max": stats.ratio_max, "kl": stats.kl,
                   "rollout/seconds": rollout_s, "rollout/tokens_per_s": lengths.sum().item() / rollout_s,
                   "train/seconds": train_s, "push/seconds": push["seconds"],
                   "push/paused_seconds": push["paused_seconds"] or 0.0, "weight_version": push["weight_version"],
                   "staleness/mean": sum(push["weight_version"] - 1 - v for v in versions) / len(versions),
                   "staleness/max": max(push["weight_version"] - 1 - v for v in versions),
                   "wall_seconds": time.perf_counter() - t_start}
            rows.append(row)
            log.log(step, row)
            print(f"[recipe] step {step:3d}  reward {row['reward/mean']:.3f}  calls {row['tool/call_rate']:.2f}  "
                  f"drift {row['tool/drift_turns']}  "
                  f"mismatch {stats.mismatch_mean:.1e}  rollout {rollout_s:.1f}s  train {train_s:.1f}s  "
                  f"v{push['weight_version']}", flush=True)
        client.close_weight_transfer()
        png = log.finish()
    print(f"[recipe] done in {time.perf_counter() - t_start:.0f} s: {png}", flush=True)
    return {"run_dir": run_dir, "rows": rows, "png": png}


if __name__ == "__main__":
    main()
