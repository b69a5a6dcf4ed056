"""Plot runs without W&B: `fnt plot RUN [RUN...] [--keys K,...] [--out FILE.png] [--smooth N]`.
Side effects: `plot_runs` writes a PNG (whole or not at all, signed "fnt plot" so that the next
plot may replace it and nothing else: fnt.store.paths.check_output_file); `main` reads run
directories (through `fnt.apps.inspect.read_run`) and prints. `series`, `smooth` and
`panel_keys` are pure.

One panel per metric key (its unit in the title: UNITS), step on the x axis, one line per run,
labelled with the run directory's name and drawn in the same colour and dash in every panel (so
runs with equal values still show each other); a validation key has a marker at each
evaluation, from the start state's (val.eval_on_start, at its step) on, and is drawn in the
panel of the training key it mirrors (val/loss with loss/mean); by default a key whose value
never changes gets no panel. A null value (how metrics.jsonl
writes NaN) is a gap in the line, never a zero; a row without the key is skipped, so a metric
logged every few steps is still one line. matplotlib is an optional extra
(`pip install 'fnt[plot]'`), imported only to draw, and drawn on the Agg canvas, so no display
or GUI toolkit is needed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Collection, Mapping, Optional, Sequence

from fnt.apps.cli import EXIT_BAD_INPUT
from fnt.apps.inspect import RunView, default_keys, notes, read_run
from fnt.errors import ConfigError, DataError
from fnt.store.paths import PLOT, check_output_file
from fnt.store.transaction import staged_file_

MISSING_MATPLOTLIB = "error: fnt plot needs matplotlib; install it with: pip install 'fnt[plot]'"
# Each panel is PANEL_SIZE inches at DPI, so the PNG is (columns * 400) x (rows * 240) pixels:
# readable, and small enough to commit or attach.
PANEL_SIZE = (5.0, 3.0)
DPI = 80
MAX_COLUMNS = 2


VAL_PREFIX, START_PREFIX = "val/", "val/start/"


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[Any]]:
    """The steps and values of `key` over the rows that have it; a null stays None. Pure.

    A validation key `val/K` also gets the start state's evaluation (val.eval_on_start), which
    a run's first row (and a resumed run's first row) holds as `val/start/K`: it is the value
    at the step before that row, step 0 for a fresh run."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    if key.startswith(VAL_PREFIX) and not key.startswith(START_PREFIX):
        start_key = START_PREFIX + key[len(VAL_PREFIX) :]
        points += [(row["step"] - 1, row[start_key]) for row in rows if start_key in row]
        points.sort(key=lambda point: point[0])  # stable: a step's own value after its start
    return [step for step, _ in points], [value for _, value in points]


def is_start_key(key: str, keys: Collection[str]) -> bool:
    """Whether `key` is `val/start/K` while `val/K` is among `keys`: it is drawn at the start of
    that key's line (`series`), so it needs no panel of its own. Pure."""
    return key.startswith(START_PREFIX) and VAL_PREFIX + key[len(START_PREFIX) :] in keys


# Units of the keys that have one, shown in their panel's title.
UNITS = {
    "perf/throughput": "tokens/s",
    "perf/throughput_per_rank": "tokens/s",
    "perf/peak_memory": "GiB",
    "time/step": "s",
    "time/forward_backward": "s",
    "time/val": "s",
    "time/save_ckpt": "s",
}

# Run i's lines are drawn in colour Ci and RUN_STYLES[i % 4], so runs with the same values
# still show each other through the gaps of the dashes; validation keys get markers.
RUN_STYLES = ("-", "--", "-.", ":")
VAL_MARKER = "o"


def key_label(key: str) -> str:
    """`perf/throughput (tokens/s)`: the key and its unit, if it has one. Pure."""
    return f"{key} ({UNITS[key]})" if key in UNITS else key


def smooth(values: Sequence[Optional[float]], n: int) -> list[Optional[float]]:
    """Trailing mean over the last `n` rows. Pure.

    A gap (None) stays a gap, and a window's gaps are left out of its mean rather than counted
    as zeros; the first rows average over the rows there are.
    """
    out: list[Optional[float]] = []
    for i, value in enumerate(values):
        window = [v for v in values[max(0, i - n + 1) : i + 1] if v is not None]
        out.append(None if value is None else sum(window) / len(window))
    return out


# A validation key shares the panel of the training key it mirrors (drawn dashed).
SHARED_PANELS = {"val/loss": "loss/mean", "val/reward/mean": "reward/mean"}
# val/reward/avg@K (val.samples = K): sampled at rollout.temperature, as reward/mean is.
SAMPLED_REWARD = "val/reward/avg@"


def panels(keys: Sequence[str]) -> list[list[str]]:
    """The panels for `keys`, in order: each key its own, except a validation key whose
    training key is drawn too, which joins that panel (SHARED_PANELS). Pure."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        home = SHARED_PANELS.get(key)
        if key.startswith(SAMPLED_REWARD):  # val.samples' held-out mirror of reward/mean
            home = "reward/mean"
        grouped.setdefault(home if home in keys else key, []).append(key)
    return list(grouped.values())


def is_constant(runs: Sequence[RunView], key: str) -> bool:
    """Whether `key` has one value in every row of every run that has it (a flat line tells
    nothing: a constant learning rate, a metric that is always 0). Pure."""
    values = {row[key] for run in runs for row in run.rows if row.get(key) is not None}
    return len(values) <= 1


def panel_keys(runs: Sequence[RunView], asked: Optional[Sequence[str]]) -> list[str]:
    """The keys that get drawn: `asked`, or the default keys present in any run whose values
    are not constant. Pure."""
    present = {key for run in runs for row in run.rows for key in row}
    listing = ", ".join(sorted(present - {"step", "time"})) or "none"
    if asked is None:
        keys = [
            key
            for key in default_keys(present)
            if not is_constant(runs, key) and not is_start_key(key, present)
        ]
        if not keys:
            raise DataError(
                f"no run has any of the default keys with changing values; --keys takes: {listing}"
            )
        return keys
    missing = [key for key in asked if key not in present]
    if missing:
        raise DataError(f"--keys: {', '.join(missing)} in no run; keys present: {listing}")
    return list(asked)


def plot_runs(
    runs: Sequence[RunView],
    keys: Sequence[str],
    out: Path,
    *,
    smooth_rows: int = 1,
    log_keys: Collection[str] = (),
) -> Any:
    """Write the PNG: a panel per key (a validation key in its training key's panel: `panels`),
    a line per run in its own colour and dash (RUN_STYLES), validation keys with a marker at
    each evaluation (the start state's at its step, `series`), units in the titles (UNITS);
    returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    groups = panels(keys)
    columns = min(len(groups), MAX_COLUMNS)
    rows = math.ceil(len(groups) / columns)
    figure = Figure(
        figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained"
    )
    FigureCanvasAgg(figure)
    handles = {}
    for index, group in enumerate(groups):
        axes = figure.add_subplot(rows, columns, index + 1)
        for key in group:
            validation = key.startswith(VAL_PREFIX)
            for number, run in enumerate(runs):
                steps, values = series(run.rows, key)
                if not steps:
                    continue
                # NaN is where matplotlib breaks a line.
                y = [math.nan if v is None else v for v in smooth(values, smooth_rows)]
                (line,) = axes.plot(
                    steps,
                    y,
                    linestyle=RUN_STYLES[number % len(RUN_STYLES)],
                    color=f"C{number}",
                    linewidth=1.0 if validation and len(group) > 1 else 1.5,
                    marker=VAL_MARKER if validation else None,
                    markersize=4,
                )
                if key == group[0]:
                    handles.setdefault(number, line)
        title = " and ".join(
            f"{key_label(key)} (markers)" if index else key_label(key)
            for index, key in enumerate(group)
        )
        axes.set_title(
            title if smooth_rows == 1 else f"{title}, mean of {smooth_rows} rows", fontsize=10
        )
        axes.set_xlabel("step", fontsize=9)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.tick_params(labelsize=8)
        axes.grid(alpha=0.3)
        if any(key in log_keys for key in group):
            axes.set_yscale("log")
    # One legend for the figure: a run keeps its colour in every panel.
    figure.legend(
        list(handles.values()),
        [runs[number].name for number in handles],
        loc="outside upper center",
        ncols=min(len(handles), 4) or 1,
        fontsize=9,
        frameon=False,
    )
    # Signed, so that the next plot may replace it (fnt.store.paths.check_output_file).
    with staged_file_(Path(out), "--out") as partial:
        figure.savefig(partial, dpi=DPI, format="png", metadata={"Software": PLOT})
    return figure


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fnt plot", description="Plot the metrics of runs as one PNG, a panel per key."
    )
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="run directories")
    parser.add_argument(
        "--keys", help="comma-separated metric keys (default: the key metrics and val/* present)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("plot.png"), metavar="FILE.png", help="default: plot.png"
    )
    parser.add_argument(
        "--smooth", type=int, default=1, metavar="N", help="trailing mean over N rows (default 1)"
    )
    parser.add_argument(
        "--log", action="append", default=[], metavar="KEY", help="log y scale for KEY (repeat)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace --out even if fnt plot did not write it"
    )
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: expected a number of rows >= 1")
    try:
        import matplotlib  # noqa: F401 - only to say which extra is missing, before any work
    except ImportError:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if args.out.suffix.lower() != ".png":
        raise ConfigError(f"--out {str(args.out)!r}: expected a .png file (fnt plot writes PNG)")
    check_output_file(args.out, "--out", PLOT, force=args.force)
    runs = [read_run(path) for path in args.runs]
    asked = [key.strip() for key in args.keys.split(",") if key.strip()] if args.keys else None
    keys = panel_keys(runs, asked)
    unknown = [key for key in args.log if key not in keys]
    if unknown:
        raise DataError(f"--log: {', '.join(unknown)} has no panel; panels: {', '.join(keys)}")
    for run in runs:
        for note in notes(run):
            print(f"note: {run.name}: {note}", file=sys.stderr)
    figure = plot_runs(runs, keys, args.out, smooth_rows=args.smooth, log_keys=args.log)
    print(f"wrote {args.out}: {len(figure.axes)} panels, {len(runs)} runs")
