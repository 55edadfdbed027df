"""The recipes, shortened, end to end: each starts its own `rollout serve` (the real default model,
float32), trains through the public client, pushes weights over gloo every step, and writes its
W&B offline runs and curves; `rollout dashboard` renders the real run.
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from recipes import grpo_arithmetic, grpo_async, multiturn_tool
from tests.rollout.conftest import children_of

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


def running() -> tuple[set, set]:
    """This process's children and threads (earlier tests may have left their own behind)."""
    return set(children_of(os.getpid())), {t.ident for t in threading.enumerate()}


def check_left_nothing_running(before: tuple[set, set]) -> None:
    children, threads = before
    assert set(children_of(os.getpid())) <= children, "a recipe left a child process running"
    extra = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive() and not t.daemon]
    assert not extra, f"a recipe left threads running: {extra}"


def check_run_folder(run_dir: Path, steps: list[int]) -> None:
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == steps
    assert (run_dir / "curves.png").stat().st_size > 10_000
    offline = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(offline) == 2, f"expected the trainer's and the server's offline W&B runs: {offline}"


def test_grpo_arithmetic_shortened(tmp_path):
    before = running()
    # batch-invariant serving: the trainer's InvariantScorer recompute equals the rollout bit for bit
    result = grpo_arithmetic.main(["--steps", "3", "--prompts", "4", "--group", "4", "--eval-problems", "32",
                                   "--run-root", str(tmp_path), "--batch-invariant"])
    rows = result["rows"]
    rewards = [r["reward/mean"] for r in rows]
    assert len(set(rewards)) > 1, f"the sampled reward never moved: {rewards}"
    # the held-out greedy reward after 3 updates differs from the one before: the pushes took
    assert rows[-1]["eval/reward"] != result["first_eval"]["eval/reward"], (rows[-1], result["first_eval"])
    for r in rows:  # the rollout's logprobs are what the trainer's float32 model computes
        assert r["mismatch/mean"] < 1e-3, r
        assert r["exact/mismatch_max"] == 0.0 and r["exact/tokens_differing"] == 0, r
        assert r["staleness/max"] == 0, "a synchronous step trained on tokens of an older version"
    assert [r["weight_version"] for r in rows] == [result["start_version"] + s for s in (1, 2, 3)]
    check_run_folder(result["run_dir"], [0, 1, 2, 3])  # step 0: the held-out reward before training
    assert "eval/reward" in rows[-1]
    check_left_nothing_running(before)
    # the dashboard draws the server's and the trainer's series of this real run together
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "dashboard", str(result["run_dir"])],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    page = (result["run_dir"] / "dashboard.html").read_text()
    for panel in ("generation throughput", "KV cache usage", "weight version", "push and pause seconds", "reward"):
        assert panel in page, f"the dashboard lacks the {panel!r} panel"
    name = result["run_dir"].name  # the runs are named as W&B names them: the trainer's and the server's
    assert f"<h3>{name}: " in page and f"<h3>{name}-server: " in page, page[:2000]
    assert (result["run_dir"] / "dashboard.png").stat().st_size > 20_000


def test_grpo_async_shortened(tmp_path):
    before = running()
    # max staleness 0: the server ends every sample a push lands in (finish_reason "stale"), so no
    # kept sequence mixes versions (here the answers often end before the push: how many samples
    # a push catches depends on timing; tests/recipes/test_grpo_async_staleness.py covers the drop)
    result = grpo_async.main(["--steps", "3", "--prompts", "2", "--group", "4", "--max-staleness", "0",
                              "--run-root", str(tmp_path)])
    rows = result["rows"]
    assert len(rows) == 3 and all(r["mismatch/mean"] < 1e-3 for r in rows[:1])
    assert all(r["staleness/within_max"] == 0 for r in rows), rows
    assert all(r["staleness/max"] <= 1 for r in rows)  # (a finished batch waits for at most --ahead 1 push)
    assert rows[-1]["stale/samples"] == result["stale"] and rows[-1]["dropped_groups"] == result["dropped_groups"]
    # the first batch was sampled wholly under the live weights: the server's recompute of one of
    # its rollouts (POST /logprobs/compare) agrees with the logprobs it sampled with
    assert rows[0]["consistency/max_abs_diff"] < 1e-2, rows[0]
    print(f"stale samples {result['stale']}, dropped groups {result['dropped_groups']}, "
          f"dropped batches {result['dropped']}")
    check_run_folder(result["run_dir"], [1, 2, 3])
    check_left_nothing_running(before)


def test_multiturn_tool_shortened(tmp_path):
    before = running()
    result = multiturn_tool.main(["--steps", "2", "--prompts", "1", "--group", "4", "--run-root", str(tmp_path)])
    rows = result["rows"]
    assert len(rows) == 2 and all(r["mismatch/mean"] < 1e-3 for r in rows)
    assert rows[0]["tool/masked_tokens"] > 0
    # turn 2 went as chat messages on turn 1's exact ids (prefix_token_ids); drift is counted
    assert all(0 <= r["tool/drift_turns"] <= 4 for r in rows)
    check_run_folder(result["run_dir"], [1, 2])
    check_left_nothing_running(before)
