"""`fnt plot`: a PNG with a panel per key and a line per run; nulls are gaps; no matplotlib."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fnt.__main__ import main
from fnt.apps.inspect import read_run
from fnt.apps.plot import DPI, PANEL_SIZE, panel_keys, panels, plot_runs, series, smooth
from fnt.store.paths import written_by_png


def imread(path: Path) -> np.ndarray:
    """The PNG's pixels. matplotlib (the plot extra) is imported here, not with the module: a
    machine without it (the GPU check's image) still collects this file, so that `pytest -m gpu
    tests` is not stopped by a collection error; these tests then fail there, as they should."""
    from matplotlib.image import imread as read

    return read(path)


# The colours of the first two runs' lines (matplotlib's C0 and C1), as 8-bit RGB.
RUN_COLOURS = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)]


def write_run(path: Path, lr: float, rows: list[dict]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"output_dir": str(path), "optim": {"lr": lr}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    """30 SFT-like rows each, with nulls in the loss; the second run has val/loss every 10."""
    runs = []
    for number, lr in enumerate([1e-3, 3e-4]):
        rows = []
        for step in range(1, 31):
            rows.append(
                {
                    "step": step,
                    "loss/mean": None if step in (7, 8) else 5.0 / (step + number),
                    "optim/lr": lr * min(1.0, step / 5),
                    "optim/grad_norm": 1.0 + 0.1 * math.sin(step),
                    "perf/throughput": 1000.0 + 10 * step + 100 * number,
                    "progress/num_tokens": 512.0 * step,
                }
            )
            if number == 1 and step % 10 == 0:
                rows[-1]["val/loss"] = 4.0 / step
        runs.append(write_run(tmp_path / f"run_{'ab'[number]}", lr, rows))
    return runs


def test_plot_of_two_runs_writes_a_panel_per_present_key(two_runs, tmp_path, capsys):
    out = tmp_path / "plot.png"

    main(["plot", *map(str, two_runs), "--out", str(out), "--smooth", "3", "--log", "optim/lr"])

    # The four default SFT keys, val/loss in the loss panel; no RL key is present.
    assert capsys.readouterr().out == f"wrote {out}: 4 panels, 2 runs\n"
    image = imread(out)
    columns, rows = 2, 2
    assert image.shape[:2] == (rows * PANEL_SIZE[1] * DPI, columns * PANEL_SIZE[0] * DPI)
    pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 1
    for colour in RUN_COLOURS:  # each run's line is drawn
        assert (pixels == colour).all(axis=1).sum() > 100, colour


def test_plot_runs_returns_its_figure_with_the_panels_asked_for(two_runs, tmp_path):
    runs = [read_run(path) for path in two_runs]

    figure = plot_runs(
        runs, ["loss/mean", "optim/lr", "val/loss"], tmp_path / "p.png", log_keys=["optim/lr"]
    )

    axes = figure.axes
    assert [a.get_title() for a in axes] == ["loss/mean and val/loss (markers)", "optim/lr"]
    assert [a.get_yscale() for a in axes] == ["linear", "log"]
    assert [len(a.get_lines()) for a in axes] == [3, 2]  # only run_b has val/loss
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["run_a", "run_b"]
    loss_a = axes[0].get_lines()[0].get_ydata()
    assert np.isnan(loss_a[6:8]).all() and not np.isnan(loss_a[:6]).any()  # nulls are gaps
    val = axes[0].get_lines()[2]
    assert val.get_marker() == "o" and list(val.get_xdata()) == [10, 20, 30]


def test_a_constant_key_gets_no_panel_by_default(two_runs, tmp_path):
    runs = [read_run(path) for path in two_runs]
    for run in runs:
        for row in run.rows:
            row["optim/grad_norm"] = 1.0
    assert "optim/grad_norm" not in panel_keys(runs, None)
    assert panel_keys(runs, ["optim/grad_norm"]) == ["optim/grad_norm"]  # asked for: drawn


def test_panels_put_a_validation_key_with_its_training_key():
    assert panels(["loss/mean", "optim/lr", "val/loss", "val/reward/mean"]) == [
        ["loss/mean", "val/loss"],
        ["optim/lr"],
        ["val/reward/mean"],
    ]
    # val.samples = 4: the held-out sampled mean joins the sampled training reward's panel.
    keys = ["reward/mean", "val/reward/mean", "val/reward/avg@4", "val/reward/pass@4"]
    assert panels(keys) == [
        ["reward/mean", "val/reward/mean", "val/reward/avg@4"],
        ["val/reward/pass@4"],
    ]


def test_series_keeps_nulls_and_skips_rows_without_the_key():
    rows = [{"step": 1, "k": 1.0}, {"step": 2}, {"step": 3, "k": None}, {"step": 4, "k": 2.0}]

    assert series(rows, "k") == ([1, 3, 4], [1.0, None, 2.0])


@given(
    values=st.lists(st.none() | st.floats(-1e6, 1e6), max_size=20),
    n=st.integers(1, 6),
)
def test_smooth_keeps_gaps_and_averages_the_window(values, n):
    out = smooth(values, n)

    assert [v is None for v in out] == [v is None for v in values]
    for i, value in enumerate(out):
        window = [v for v in values[max(0, i - n + 1) : i + 1] if v is not None]
        if value is not None:
            assert min(window) - 1e-6 <= value <= max(window) + 1e-6
    assert smooth(values, 1) == values


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, None, 5.0, 7.0], 2) == [1.0, 2.0, None, 5.0, 6.0]


def test_a_key_in_no_run_is_named_with_the_keys_there_are(two_runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(two_runs[0]), "--keys", "loss/mean,reward/mean"])

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --keys: reward/mean in no run; keys present: loss/mean,")


def test_without_matplotlib_plot_names_the_extra_and_exits_2(two_runs, monkeypatch, capsys):
    # None in sys.modules makes `import matplotlib` raise ImportError, as when it is missing.
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(two_runs[0])])

    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: fnt plot needs matplotlib; install it with: pip install 'fnt[plot]'\n"
    )


def test_a_plot_replaces_its_own_png_and_another_file_only_with_force(two_runs, tmp_path):
    out = tmp_path / "plot.png"
    main(["plot", str(two_runs[0]), "--out", str(out)])
    assert written_by_png(out) == "fnt plot"
    first = out.read_bytes()
    main(["plot", *map(str, two_runs), "--out", str(out)])  # its own: replaced
    assert out.read_bytes() != first and written_by_png(out) == "fnt plot"
    other = tmp_path / "figure.png"
    other.write_bytes(b"someone's figure")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(two_runs[0]), "--out", str(other)])
    assert exit_info.value.code == 2 and other.read_bytes() == b"someone's figure"
    main(["plot", str(two_runs[0]), "--out", str(other), "--force"])
    assert written_by_png(other) == "fnt plot"
    assert sorted(p.name for p in tmp_path.glob("*.png*")) == ["figure.png", "plot.png"]


# ---------------------------------------------------------------------------------------------
# What a reader needs to see: validation points, the start state's, units, every run


def rows_with_val(offset: float = 0.0) -> list[dict]:
    """10 rows with val/loss every 5 steps and, as val.eval_on_start leaves it, val/start/loss
    in the first row."""
    rows = []
    for step in range(1, 11):
        row = {"step": step, "loss/mean": 4.0 - 0.2 * step + offset, "perf/throughput": 900.0}
        row["perf/throughput"] += 10 * step
        if step % 5 == 0:
            row["val/loss"] = 4.5 - 0.2 * step + offset
        rows.append(row)
    rows[0]["val/start/loss"] = 4.6 + offset
    return rows


def test_validation_points_have_markers_from_the_start_states_at_step_0(tmp_path):
    run = read_run(write_run(tmp_path / "run", 1e-3, rows_with_val()))
    assert series(run.rows, "val/loss") == ([0, 5, 10], [4.6, 3.5, 2.5])
    assert panel_keys([run], None) == ["loss/mean", "perf/throughput", "val/loss"]

    figure = plot_runs([run], ["loss/mean", "val/loss"], tmp_path / "p.png")

    loss, val = figure.axes[0].get_lines()
    assert loss.get_marker() in ("None", None, "") and list(loss.get_xdata())[0] == 1
    assert val.get_marker() == "o" and list(val.get_xdata()) == [0, 5, 10]


def test_a_resumed_runs_start_evaluation_sits_at_the_checkpoints_step():
    rows = [{"step": 7, "val/start/loss": 2.0}, {"step": 8, "val/loss": 1.9}]
    assert series(rows, "val/loss") == ([6, 8], [2.0, 1.9])


def test_throughput_is_titled_with_its_unit(tmp_path):
    run = read_run(write_run(tmp_path / "run", 1e-3, rows_with_val()))
    figure = plot_runs([run], ["perf/throughput", "loss/mean"], tmp_path / "p.png")
    assert [a.get_title() for a in figure.axes] == ["perf/throughput (tokens/s)", "loss/mean"]


def colour_pixels(path: Path, colour: tuple[int, int, int]) -> int:
    """Pixels inked in `colour`, antialiased ones too: those whose difference from white points
    the way the colour's does (cosine > 0.99) and is not faint."""
    ink = 255 - (imread(path)[..., :3] * 255).reshape(-1, 3)
    direction = 255 - np.array(colour, dtype=float)
    norms = np.linalg.norm(ink, axis=1)
    cosine = ink @ direction / (norms * np.linalg.norm(direction) + 1e-9)
    return int(((cosine > 0.99) & (norms > 40)).sum())


def test_two_runs_with_equal_values_do_not_hide_each_other(tmp_path):
    runs = [read_run(write_run(tmp_path / name, 1e-3, rows_with_val())) for name in ("a", "b")]
    alone, both = tmp_path / "alone.png", tmp_path / "both.png"
    plot_runs(runs[:1], ["loss/mean"], alone)
    figure = plot_runs(runs, ["loss/mean"], both)

    first, second = figure.axes[0].get_lines()
    assert first.get_color() != second.get_color()
    assert first.get_linestyle() != second.get_linestyle()
    # The first run's line still shows through the gaps of the second's dashes drawn over it
    # (a quarter of its pixels; drawn alike, only its legend swatch, 5%, would).
    assert colour_pixels(both, RUN_COLOURS[0]) > 0.15 * colour_pixels(alone, RUN_COLOURS[0])
    assert colour_pixels(both, RUN_COLOURS[1]) > 100
