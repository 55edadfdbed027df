"""`rollout dashboard RUN_DIR...`: the server's and the trainer's series of offline runs drawn
together, on one wall-clock axis, as one PNG and one HTML page (the PNG and a table of the last
values), so a person can look without W&B.

A RUN_DIR is a recipe's run folder (its `history.jsonl`: the trainer's series; the offline W&B
runs under it: the server's, logged with `rollout serve --wandb-project`), a folder of W&B runs
(`wandb/`), or one offline W&B run (`offline-run-*`). W&B runs are read with wandb's own reader
of its transaction log (`wandb leet inspect --json`). Legends name each run as W&B does (the
name given to wandb.init / `--wandb-run-name`); the time axis is seconds since the first row any
run logged, its UTC time in the axis label.
"""
from __future__ import annotations

import html
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

PANELS = [  # (title, series, y-axis label); a panel shows the series any run has
    ("generation throughput (tokens/s)", ["engine/throughput_tokens_per_s", "rollout/tokens_per_s"], "tokens/s"),
    ("KV cache usage", ["engine/kv_usage"], "fraction of KV blocks in use (0-1)"),
    ("prefix-cache hit rate", ["engine/prefix_hit_rate"], "fraction of prompt tokens (0-1)"),
    ("requests", ["engine/num_running", "engine/num_waiting"], "requests"),
    ("weight version", ["engine/weight_version", "weight_version"], "version"),
    ("push and pause seconds", ["server/last_weight_update_s", "server/last_pause_s", "push/seconds",
                                "push/paused_seconds"], "seconds"),
    ("reward", ["reward/mean", "reward/std", "eval/reward"], "reward"),
    ("logprob mismatch (rollout vs trainer)", ["mismatch/mean", "mismatch/max"], "|logprob difference|"),
]
SPARSE = 3  # a series sampled 3x less often than its panel's densest is drawn as points, not a line


def read_wandb_run(run: Path) -> list[dict]:
    """The history rows of one offline W&B run (each with its `_timestamp`)."""
    return [r["history"]["item"] for r in _inspect(run) if r.get("type") == "history"]


def _inspect(run: Path) -> list[dict]:
    """Every record of an offline W&B run's transaction log, read by wandb's own reader."""
    cli = Path(sys.executable).parent / "wandb"
    cmd = [str(cli) if cli.exists() else (shutil.which("wandb") or "wandb"), "leet", "inspect", "--json", str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"reading the W&B run {run} failed: {out.stderr.strip()[-500:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _run_name(records: list[dict], run: Path) -> str:
    """The run's name as W&B shows it (wandb.init(name=...), `rollout serve --wandb-run-name`), else
    its job type and id (an offline run without a name gets one only when synced)."""
    info = next((r["run"] for r in records if r.get("type") == "run"), {})
    return info.get("display_name") or f"{info.get('job_type') or 'run'} {info.get('run_id') or run.name}"


def load_runs(paths: list[str | Path]) -> dict[str, list[dict]]:
    """{run name: rows}; every row has "time" (seconds since the epoch). A recipe's history.jsonl
    is named after the trainer's W&B run, and that run (the same rows) is not read twice."""
    runs: dict[str, list[dict]] = {}
    paths = [Path(p) for p in paths]
    for p in paths:
        prefix = "" if len(paths) == 1 else f"{p.name}: "
        if not p.exists():
            raise FileNotFoundError(f"no such run folder: {p}")
        history, trainer = p / "history.jsonl", "trainer"
        for w in [p] if p.name.startswith("offline-run-") else sorted(p.glob("**/offline-run-*")):
            records = _inspect(w)
            rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
            name = _run_name(records, w)
            if history.exists() and not any(k.startswith("engine/") for r in rows for k in r):
                trainer = name  # the trainer's own W&B copy of history.jsonl
                continue
            key = prefix + name if prefix + name not in runs else f"{prefix}{name} ({w.name.rsplit('-', 1)[-1]})"
            runs[key] = [dict(r, time=r.get("_timestamp")) for r in rows]
        if history.exists():
            runs[prefix + trainer] = [json.loads(line) for line in history.read_text().splitlines() if line]
    if not runs:
        raise ValueError(f"no runs found under {', '.join(map(str, paths))}")
    return runs


def plot_series(runs: dict[str, list[dict]], panels: list[tuple], path: Path, x: str = "time",
                title: str = "") -> list[str]:
    """One PNG of figure(...); returns the panel titles drawn."""
    import matplotlib.pyplot as plt

    fig, shown = figure(runs, panels, x, title)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return shown


def figure(runs: dict[str, list[dict]], panels: list[tuple], x: str = "time", title: str = ""):
    """A panel per (title, series[, y label]) that some run has, each series a line per run, against
    x: "time" (seconds since the first row of any run) or a row key such as "step".
    Returns (the matplotlib Figure, the panel titles drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    t0 = min((r["time"] for rows in runs.values() for r in rows if r.get("time") is not None), default=0.0)
    shown = [p for p in panels if any(name in r for rows in runs.values() for r in rows for name in p[1])]
    if not shown:
        raise ValueError("none of the runs has any of the series to draw")
    cols = 2 if len(shown) > 1 else 1
    rows_n = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.4 * cols, 3.0 * rows_n), squeeze=False)
    xlabel = (f"seconds since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0))} UTC (the first logged row)"
              if x == "time" else x)
    for ax, (panel, names, *ylabel) in zip(axes.flat, shown):
        series = {(run, name): [(r[x] - (t0 if x == "time" else 0), r[name]) for r in rows
                                if isinstance(r.get(name), (int, float)) and r.get(x) is not None]
                  for run, rows in runs.items() for name in names}
        _draw_panel(ax, {k: pts for k, pts in series.items() if pts}, one_run=len(runs) == 1)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel[0] if ylabel else "", fontsize=8)
        if x != "time":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig, [p[0] for p in shown]


def _draw_panel(ax, series: dict[tuple[str, str], list[tuple[float, float]]], one_run: bool) -> None:
    """A series sampled much less often than the panel's densest one (a trainer's step every 20 s
    beside a server's row every 2 s) is drawn as points; the others as lines, broken where a gap is
    longer than SPARSE sample intervals. Integer-valued panels (versions, counts) get integer ticks."""
    from matplotlib.ticker import MaxNLocator

    interval = {k: _median_gap(pts) for k, pts in series.items()}
    densest = min((g for g in interval.values() if g), default=0.0)
    for (run, name), pts in series.items():
        label = name if one_run else f"{name} [{run}]"
        gap = interval[(run, name)]
        if gap and densest and gap > SPARSE * densest:
            ax.plot(*zip(*pts), linestyle="none", marker="o", markersize=4, label=label)
            continue
        xs, ys = [], []
        for i, (px, py) in enumerate(pts):
            if i and gap and px - pts[i - 1][0] > SPARSE * gap:
                xs.append(float("nan"))  # a gap: no line across it
                ys.append(float("nan"))
            xs.append(px)
            ys.append(py)
        ax.plot(xs, ys, marker="." if len(pts) < 40 else None, label=label)
    if series and all(float(v).is_integer() for pts in series.values() for _, v in pts):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _median_gap(pts: list[tuple[float, float]]) -> float:
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(pts) if b[0] > a[0])
    return gaps[len(gaps) // 2] if gaps else 0.0


def render(paths: list[str | Path], out_dir: Path) -> tuple[Path, Path]:
    """dashboard.png and dashboard.html in out_dir."""
    runs = load_runs(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "dashboard.png"
    panels = plot_series(runs, PANELS, png, title="rollout: server and trainer")
    names = [n for p in PANELS for n in p[1]]
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
