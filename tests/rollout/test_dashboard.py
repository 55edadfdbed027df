"""`rollout dashboard` without comparing images: what a reader of the PNG relies on is checked on
the matplotlib figure (axis labels, legend names, integer ticks, which series are lines and which
points), and a real offline W&B run is read for the run's name.
"""
import json
import math

import pytest

from rollout import dashboard

T0 = 1_795_550_000.0  # 2026-11-24 19:53:20 UTC


def server_rows(n=60, every_s=2.0):
    return [{"time": T0 + i * every_s, "engine/kv_usage": 0.01 * i, "engine/weight_version": i // 10,
             "engine/throughput_tokens_per_s": 100.0 + i, "server/last_weight_update_s": 0.5} for i in range(n)]


def trainer_rows(n=6, every_s=20.0):
    return [{"step": s, "time": T0 + 5 + s * every_s, "weight_version": s, "rollout/tokens_per_s": 80.0 + s,
             "push/seconds": 0.4, "reward/mean": 0.1 * s} for s in range(1, n + 1)]


@pytest.fixture
def figure():
    import matplotlib.pyplot as plt

    runs = {"demo-server": server_rows(), "demo": trainer_rows()}
    fig, shown = dashboard.figure(runs, dashboard.PANELS, title="t")
    yield {ax.get_title(): ax for ax in fig.axes if ax.get_title()}, shown
    plt.close(fig)


def test_axes_say_their_reference_and_units(figure):
    axes, shown = figure
    assert "reward" in shown and "logprob mismatch (rollout vs trainer)" not in shown  # no such series
    for ax in axes.values():
        assert ax.get_xlabel() == "seconds since 2026-11-24 19:53:20 UTC (the first logged row)"
    assert axes["KV cache usage"].get_ylabel() == "fraction of KV blocks in use (0-1)"
    assert axes["generation throughput (tokens/s)"].get_ylabel() == "tokens/s"


def test_legends_name_the_runs(figure):
    axes, _ = figure
    legend = [t.get_text() for t in axes["weight version"].get_legend().get_texts()]
    assert legend == ["engine/weight_version [demo-server]", "weight_version [demo]"]


def test_versions_get_integer_ticks(figure):
    axes, _ = figure
    ticks = axes["weight version"].get_yticks()
    assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks), ticks
    assert not all(float(t).is_integer() for t in axes["KV cache usage"].get_yticks())


def test_sparse_series_are_points_dense_ones_lines(figure):
    axes, _ = figure
    lines = {line.get_label(): line for line in axes["weight version"].get_lines()}
    assert lines["weight_version [demo]"].get_linestyle() == "None"  # every 20 s beside a 2 s series
    assert lines["weight_version [demo]"].get_marker() == "o"
    assert lines["engine/weight_version [demo-server]"].get_linestyle() == "-"


def test_a_gap_breaks_the_line():
    import matplotlib.pyplot as plt

    rows = server_rows(20) + [dict(r, time=r["time"] + 300) for r in server_rows(20)]  # 5 minutes of nothing
    fig, _ = dashboard.figure({"s": rows}, [("KV cache usage", ["engine/kv_usage"])])
    (line,) = fig.axes[0].get_lines()
    assert sum(math.isnan(v) for v in line.get_xdata()) == 1
    plt.close(fig)


def test_step_axis_has_integer_ticks():
    import matplotlib.pyplot as plt

    fig, _ = dashboard.figure({"demo": trainer_rows(3)}, [("reward", ["reward/mean"])], x="step")
    assert fig.axes[0].get_xlabel() == "step"
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())
    plt.close(fig)


def test_a_recipe_folder_names_its_runs_as_wandb_does(tmp_path, monkeypatch):
    """The server's offline W&B run is named by its display name (a real run, read by wandb's
    reader); history.jsonl by the trainer's W&B run, which is not drawn twice."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, job, row in [("demo-server", "rollout-server", {"engine/kv_usage": 0.25}),
                           ("demo", "trainer", {"reward/mean": 0.5})]:
        run = wandb.init(project="p", name=name, job_type=job, mode="offline", dir=str(tmp_path))
        run.log(row)
        run.finish()
    wandb.teardown()
    (tmp_path / "history.jsonl").write_text("\n".join(json.dumps(r) for r in trainer_rows(2)) + "\n")
    runs = dashboard.load_runs([tmp_path])
    assert sorted(runs) == ["demo", "demo-server"]
    assert runs["demo-server"][0]["engine/kv_usage"] == 0.25 and len(runs["demo"]) == 2
    png, page = dashboard.render([tmp_path], tmp_path / "out")
    assert "<h3>demo-server: 1 rows</h3>" in page.read_text() and png.stat().st_size > 10_000
