"""What the recipes share: the rollout server they start, the task and its verifiable reward, the
trainer's logprob recompute, the GRPO loss, and the run log (W&B offline + history.jsonl + one
PNG of the curves; without the wandb package, W&B is left out). Everything here uses the public
client only; nothing reaches into engine/.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.cli import HelpFormatter
from rollout.subprocess_server import served

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- the command line ------------------------------------------------------------------------------
class _RecipeHelp(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The recipe's docstring as written (its examples keep their lines), flags with their defaults."""


def recipe_parser(doc: str, steps: int, prompts: int, max_tokens: int, max_tokens_help: str) -> argparse.ArgumentParser:
    """The flags every recipe takes, each with its help and default; `doc`, the recipe's module
    docstring, is the description."""
    ap = argparse.ArgumentParser(description=doc, allow_abbrev=False, formatter_class=_RecipeHelp)
    ap.add_argument("--url", default=None, help="a running rollout server (default: start one, float32, any free port)")
    ap.add_argument("--steps", type=int, default=steps, help="training steps (one weight push each)")
    ap.add_argument("--prompts", type=int, default=prompts, help="problems per step")
    ap.add_argument("--group", type=int, default=8, help="answers sampled per problem (GRPO's group)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    ap.add_argument("--lr", type=float, default=3e-5, help="the trainer's AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seeds the problems, the sampling and the trainer")
    ap.add_argument("--run-root", default=None, help="where run folders go (default: runs/ in the repository)")
    return ap


# ---- the server ----------------------------------------------------------------------------------
@contextlib.contextmanager
def rollout_server(url: str | None, run_dir: Path, *extra: str):
    """Yield the URL of a rollout server: `url` as given, or a `rollout serve` started here (float32,
    any free port, its W&B run offline beside the trainer's in run_dir) and stopped on exit."""
    if url:
        yield url
        return
    wandb = ["--wandb-project", "rollout-recipes", "--wandb-run-name", f"{run_dir.name}-server",
             "--wandb-interval-s", "2"] if wandb_installed() else []
    args = ["--dtype", "float32", *wandb, *extra]
    with served(*args, log_path=run_dir / "server.log", cwd=REPO_ROOT,
                env={"WANDB_DIR": str(run_dir), "WANDB_SILENT": "true"}) as server:
        print(f"[recipe] rollout server at {server.url} (log: {server.log_path})", flush=True)
        yield server.url


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def new_run_dir(recipe: str, root: str | None) -> Path:
    d = Path(root or REPO_ROOT / "runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- the task: 2-digit addition, answered as "Answer: N" ------------------------------------------
# a short system prompt (the template's default one is longer: the prompt is most of a step's compute)
EXAMPLE = [{"role": "system", "content": "You are a calculator."},
           {"role": "user", "content": "What is 12 + 31?"}, {"role": "assistant", "content": "Answer: 43"}]
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def arithmetic_problem(rng: random.Random) -> tuple[list[dict], int]:
    """A chat (one worked example, then the question) and its answer."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return EXAMPLE + [{"role": "user", "content": f"What is {a} + {b}?"}], a + b


def arithmetic_reward(text: str, answer: int) -> float:
    """1 for the right number in the format; partial credit (up to 0.5) for a formatted answer
    within 20 of it; 0 without the format. Verifiable: a regex and an integer comparison."""
    m = ANSWER.search(text)
    if m is None:
        return 0.0
    error = abs(int(m.group(1)) - answer)
    return 1.0 if error == 0 else 0.5 * max(0.0, 1.0 - error / 20.0)


# ---- the trainer's side ----------------------------------------------------------------------------
def load_policy(path: str, device: str = "cpu") -> torch.nn.Module:
    """The model the server serves, in float32 on `device` (the trainer's copy)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def start_trainer(client, lr: float, kl_coef: float = 0.0, device: str = "cpu"):
    """The trainer's side of a recipe: its float32 copy of the served model on `device`, a frozen
    reference copy when a KL term needs one, AdamW, and on the CPU the weight-transfer group
    (this process is rank 0; on CUDA the pushes go by push_weights_shared, CUDA IPC, no group).
    Returns (model, ref, optimizer, the live weight version, the model folder)."""
    model_path = client.model_info()[0]["root"]
    model = load_policy(model_path, device)
    ref = load_policy(model_path, device).eval() if kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if device == "cpu":
        client.init_weight_transfer(backend="gloo")
    return model, ref, opt, client.weight_version(), model_path


def token_logprobs(model, sequences: list[list[int]], scored: list[list[bool]]) -> torch.Tensor:
    """The logprob of every scored token (flattened, in order) given everything before it.
    Sequences that share a prefix (a GRPO group: one prompt, several answers) are scored as
    one batch whose prefix runs once, its KV repeated for each (gradients flow through it);
    only the positions that predict a scored token go through the LM head. On the model's device."""
    groups: list[list[int]] = []
    for i, seq in enumerate(sequences):  # consecutive sequences with the same first half-prompt
        if groups and _shared(sequences[groups[-1][0]], seq, scored[i]) >= 8:
            groups[-1].append(i)
        else:
            groups.append([i])
    return torch.cat([_group_logprobs(model, [sequences[i] for i in g], [scored[i] for i in g]) for g in groups])


def _shared(a: list[int], b: list[int], b_scored: list[bool]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and not b_scored[n]:
        n += 1
    return n


def _group_logprobs(model, seqs: list[list[int]], scored: list[list[bool]]) -> torch.Tensor:
    # the shared prefix stops before the first position that predicts a scored token
    first = min(m.index(True) for m in scored)
    prefix = min(min(_shared(seqs[0], s, m) for s, m in zip(seqs, scored)), first - 1)
    cache, device = None, model.lm_head.weight.device
    if prefix > 0:
        cache = model.model(input_ids=torch.tensor([seqs[0][:prefix]], device=device), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(seqs))
    rest = [s[prefix:] for s in seqs]
    width = max(map(len, rest))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), prefix + width, dtype=torch.long)
    predicts = torch.zeros(len(seqs), width, dtype=torch.bool)  # position t predicts token t + 1
    targets = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rest, scored)):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :prefix + len(r)] = 1
        predicts[i, :len(r) - 1] = torch.tensor(m[prefix + 1:])
        targets[i, :len(r) - 1] = torch.tensor(r[1:])
    ids, attn, predicts, targets = (t.to(device) for t in (ids, attn, predicts, targets))
    hidden = model.model(input_ids=ids, attention_mask=attn, past_key_values=cache, use_cache=cache is not None)
    logits = model.lm_head(hidden.last_hidden_state[predicts]).float()
    return torch.log_softmax(logits, -1).gather(1, targets[predicts][:, None])[:, 0]


def group_advantages(rewards: list[float], group_size: int) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (0 where a group is uniform)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return adv.flatten()


@dataclass
class LossStats:
    mismatch_mean: float  # |trainer logprob - rollout logprob| per token, before this step's update
    mismatch_max: float
    ratio_std: float  # the importance ratio's spread (trainer / rollout, per token)
    ratio_max: float
    kl: float  # to the reference policy (k3 estimator), 0 without one
    clipped: float  # fraction of tokens whose ratio was clipped


def grpo_loss(new_lp: torch.Tensor, rollout_lp: torch.Tensor, adv: torch.Tensor, ref_lp: torch.Tensor | None = None,
              prox_lp: torch.Tensor | None = None, clip: float = 0.2, kl_coef: float = 0.0,
              is_cap: float = 2.0) -> tuple[torch.Tensor, LossStats]:
    """GRPO's clipped objective, token level (every argument is per scored token, flattened).
    ratio = pi_new / pi_prox, clipped to [1 - clip, 1 + clip]; pi_prox is the trainer's policy
    before this update (default: the rollout's, which it equals on-policy). Off-policy rollouts
    (sampled by older weights) add a truncated importance weight min(pi_prox / pi_rollout, is_cap)."""
    prox = rollout_lp if prox_lp is None else prox_lp
    ratio = torch.exp(new_lp - prox)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    if prox_lp is not None:
        surrogate = surrogate * torch.exp(prox_lp - rollout_lp).clamp(max=is_cap)
    loss = -surrogate.mean()
    kl = torch.zeros(())
    if ref_lp is not None:
        d = ref_lp - new_lp
        kl = (torch.exp(d) - d - 1).mean()
        loss = loss + kl_coef * kl
    with torch.no_grad():
        gap = (new_lp.detach() - rollout_lp).abs()
        behaviour = torch.exp(new_lp.detach() - rollout_lp)
        stats = LossStats(gap.mean().item(), gap.max().item(), behaviour.std().item() if behaviour.numel() > 1
                          else 0.0, behaviour.max().item(), kl.item(),
                          ((ratio - 1).abs() > clip).float().mean().item())
    return loss, stats


# ---- the run log -----------------------------------------------------------------------------------
PLOTS = [  # (title, series) drawn against the step
    ("reward", ["reward/mean", "reward/std", "eval/reward"]),
    ("logprob mismatch (rollout vs trainer)", ["mismatch/mean", "mismatch/max"]),
    ("importance ratio", ["ratio/std", "ratio/max"]),
    ("KL to the initial policy", ["kl"]),
    ("rollout tokens/s", ["rollout/tokens_per_s"]),
    ("seconds", ["push/seconds", "push/paused_seconds", "train/seconds", "rollout/seconds"]),
    ("weight-version staleness", ["staleness/mean", "staleness/max", "staleness/within_max"]),
    ("tool calls (multiturn_tool)", ["tool/call_rate"]),
]


class RunLog:
    """W&B (offline without an API key; none without the wandb package) and history.jsonl in
    run_dir, and curves.png drawn from the same rows (every `png_every` steps and at the end)."""

    def __init__(self, run_dir: Path, name: str, config: dict, png_every: int = 5):
        from rollout.metrics import wandb_has_api_key

        self.run_dir, self.name, self.png_every = run_dir, name, png_every
        self.run = None
        if wandb_installed():
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_api_key() else "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project="rollout-recipes", name=name, config=config, mode=mode, dir=str(run_dir),
                                  job_type="trainer")
        else:
            print("[recipe] no wandb package: no W&B runs (history.jsonl and curves.png only)", flush=True)
        self.rows: list[dict] = []
        self.history = open(run_dir / "history.jsonl", "a")
        (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))

    def log(self, step: int, row: dict) -> None:
        row = {"step": step, "time": time.time(), **row}
        self.rows.append(row)
        self.history.write(json.dumps(row) + "\n")
        self.history.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k not in ("step", "time")}, step=step)
        if step % self.png_every == 0:
            self.plot()

    def plot(self) -> Path:
        from rollout.dashboard import plot_series

        path = self.run_dir / "curves.png"
        plot_series({self.name: self.rows}, PLOTS, path, x="step", title=self.name)
        return path

    def finish(self) -> Path:
        path = self.plot()
        self.history.close()
        if self.run is not None:
            import wandb

            self.run.finish()
            wandb.teardown()  # stop wandb's background service process: a recipe leaves nothing running
        return path
