"""`rollout dashboard RUN_DIR...`: the server's and the trainer's series of offline runs drawn
together, on one wall-clock axis, as one PNG and one HTML page (the PNG and a table of the last
values), so a person can look without W&B.

A RUN_DIR is a recipe's run folder (its `history.jsonl`: the trainer's series; the offline W&B
runs under it: the server's, logged with `rollout serve --wandb-project`), a folder of W&B runs
(`wandb/`), or one offline W&B run (`offline-run-*`). W&B runs are read with wandb's own reader
of its transaction log (`wandb leet inspect --json`).
"""
from __future__ import annotations

import html
import json
import shutil
import subprocess
import sys
from pathlib import Path

PANELS = [  # (title, series); a panel shows the series any run has
    ("generation throughput (tokens/s)", ["engine/throughput_tokens_per_s", "rollout/tokens_per_s"]),
    ("KV cache usage", ["engine/kv_usage"]),
    ("prefix-cache hit rate", ["engine/prefix_hit_rate"]),
    ("requests", ["engine/num_running", "engine/num_waiting"]),
    ("weight version", ["engine/weight_version", "weight_version"]),
    ("push and pause seconds", ["server/last_weight_update_s", "server/last_pause_s", "push/seconds",
                                "push/paused_seconds"]),
    ("reward", ["reward/mean", "reward/std", "eval/reward"]),
    ("logprob mismatch (rollout vs trainer)", ["mismatch/mean", "mismatch/max"]),
]


def read_wandb_run(run: Path) -> list[dict]:
    """The history rows of one offline W&B run (each with its `_timestamp`)."""
    cli = Path(sys.executable).parent / "wandb"
    cmd = [str(cli) if cli.exists() else (shutil.which("wandb") or "wandb"), "leet", "inspect", "--json", str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading the W&B run {run} failed: {out.stderr.strip()[-500:]}")
    rows = []
    for line in out.stdout.splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("type") == "history":
                rows.append(record["history"]["item"])
    return rows


def load_runs(paths: list[str | Path]) -> dict[str, list[dict]]:
    """{run name: rows}; every row has "time" (seconds since the epoch)."""
    runs: dict[str, list[dict]] = {}
    paths = [Path(p) for p in paths]
    for p in paths:
        label = "" if len(paths) == 1 else f"{p.name} "
        if not p.exists():
            raise FileNotFoundError(f"no such run folder: {p}")
        history = p / "history.jsonl"
        if history.exists():  # a recipe's trainer (its W&B run holds the same rows)
            runs[f"{label}trainer"] = [json.loads(line) for line in history.read_text().splitlines() if line]
        wandb_runs = [p] if p.name.startswith("offline-run-") else sorted(p.glob("**/offline-run-*"))
        for w in wandb_runs:
            rows = read_wandb_run(w)
            if history.exists() and not any(k.startswith("engine/") for r in rows for k in r):
                continue  # the trainer's own W&B copy of history.jsonl
            kind = "server" if any(k.startswith("engine/") for r in rows for k in r) else "run"
            runs[f"{label}{kind} {w.name.rsplit('-', 1)[-1]}"] = [dict(r, time=r.get("_timestamp")) for r in rows]
    if not runs:
        raise ValueError(f"no runs found under {', '.join(map(str, paths))}")
    return runs


def plot_series(runs: dict[str, list[dict]], panels: list[tuple[str, list[str]]], path: Path, x: str = "time",
                title: str = "") -> list[str]:
    """One PNG: a panel per (title, series) that some run has, each series a line per run.
    x="time": seconds since the earliest row of all runs. Returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((r["time"] for rows in runs.values() for r in rows if r.get("time") is not None), default=0.0)
    shown = [(t, names) for t, names in panels
             if any(name in r for rows in runs.values() for r in rows for name in names)]
    if not shown:
        raise ValueError("none of the runs has any of the series to draw")
    cols = 2 if len(shown) > 1 else 1
    rows_n = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.4 * cols, 3.0 * rows_n), squeeze=False)
    for ax, (panel, names) in zip(axes.flat, shown):
        for run, rows in runs.items():
            for name in names:
                pts = [(r[x] - (t0 if x == "time" else 0), r[name]) for r in rows
                       if isinstance(r.get(name), (int, float)) and r.get(x) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="." if len(pts) < 40 else None,
                            label=name if len(runs) == 1 else f"{name} [{run}]")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("seconds" if x == "time" else x, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [t for t, _ in shown]


def render(paths: list[str | Path], out_dir: Path) -> tuple[Path, Path]:
    """dashboard.png and dashboard.html in out_dir."""
    runs = load_runs(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "dashboard.png"
    panels = plot_series(runs, PANELS, png, title="rollout: server and trainer")
    names = [n for _, names in PANELS for n in names]
    table = []
    for run, rows in runs.items():
        last = {n: r[n] for r in rows for n in names if isinstance(r.get(n), (int, float))}
        cells = "".join(f"<tr><td>{html.escape(n)}</td><td>{v:.4g}</td></tr>" for n, v in last.items())
        table.append(f"<h3>{html.escape(run)}: {len(rows)} rows</h3><table>{cells}</table>")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>rollout dashboard</title></head><body>"
            f"<h1>rollout dashboard</h1><p>{len(runs)} run(s); panels: {html.escape(', '.join(panels))}</p>"
            f"<img src='{png.name}' style='max-width:100%'><h2>last values</h2>{''.join(table)}</body></html>")
    page_path = out_dir / "dashboard.html"
    page_path.write_text(page)
    return png, page_path
