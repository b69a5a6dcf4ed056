"""Look at a run directory without W&B: `fnt inspect RUN [--json] [--diff OTHER_RUN]`.
Side effects: `read_run` reads a run directory (and /proc/locks, to learn whether a process holds
its lock) and `main` prints; `parse_metrics`, `summary`, `run_state`, `format_summary` and
`config_diff` are pure. Nothing here imports torch, so `fnt inspect` (and
`fnt plot`, which reads runs through `read_run`) answers in a fraction of a second.

A run directory (docs/design.md, "Run directory") has config.json or metrics.jsonl or both. It may
still be being written: a last line of metrics.jsonl counts only once it ends with a newline and
parses; until then it is left out, with a note. Any other line that is not a row is a DataError.

`fnt inspect --json` prints one JSON object; a value the run does not have is null:

- `run`: the directory's name; `path`: the path as given;
- `model`: config `model.name`; `step`: the last row's step; `max_steps`: config `max_steps`;
- `metrics`: the last row's key metrics (`KEY_METRICS`, with an RL run's episode counts, and
  any named rewards `reward/NAME/mean` and `val/*` keys it has), by key;
- `num_tokens`, `num_samples`: the last row's `progress/num_tokens` and `progress/num_samples`;
- `wall_time_s`: the last row's `time` minus the first row's, plus the first step's own
  `time/step` (a pause between a crash and its resume counts too);
- `best_checkpoint`: `{"step", "key", "value", "mode"}` of the checkpoint that ckpt.keep_best
  keeps (the lowest, or with "max:", the highest value of its key among the complete
  checkpoints' rows), null when the run keeps none;
- `checkpoints`: the steps of the complete checkpoints, ascending; `partial`: the `step_N.partial`
  directories (a save in progress, or one a crash cut short); `stray`: every other entry of
  checkpoints/, such as a `step_N` without its COMPLETE marker; resume ignores both kinds;
- `rows_beyond_checkpoint`: `{"first": A, "last": B, "checkpoint": N}` when rows A..B are newer
  than the newest complete checkpoint `step_N` (N is null when none is complete): the steps a
  resume redoes; null when no row is;
- `missing_steps`: the steps up to the last row's that have no row: those a resume found
  unreadable (recorded in metrics_missing.json) and any other gap; `duplicated_steps`: the
  steps with more than one row (a resume keeps the last);
- `wandb_run_id`: the contents of `wandb_run_id`;
- `state`: `running` (a process holds run.lock), `finished` (the last row is step max_steps and,
  with ckpt.save_final, its checkpoint is complete), `stopped` (not running, the last row's step
  is the newest complete checkpoint and nothing is half-written: a preemption, or a crash before
  the next step wrote anything), `crashed` (any other run not running: rows beyond the newest
  checkpoint, an unfinished save or a torn last row), or `unknown` (run.lock names another
  machine, or no config.json);
  `state_text`: the sentence `fnt inspect` prints, naming the step it crashed in (`run_state`);
- `notes`: sentences about what was missing or left out;
- `config_diff`, only with `--diff`: `{"other": PATH, "keys": {"dotted.key": [this, other]}}`
  for every config key whose values differ, `"<absent>"` on the side whose config lacks it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional, Union

from fnt.config import flatten
from fnt.errors import DataError
from fnt.store.best import Best, best_step
from fnt.store.paths import require_dir
from fnt.store.rundir import (
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    METRICS_MISSING_FILE,
    WANDB_ID_FILE,
    ckpt_root,
    complete_steps,
    list_step_dirs,
    partial_step_of,
    read_missing_steps,
    step_name,
    step_ranges,
)

# The metrics worth a glance, in display order; the RL ones appear only in RL runs.
KEY_METRICS = (
    "loss/mean",
    "optim/lr",
    "optim/grad_norm",
    "perf/throughput",
    "reward/mean",
    "entropy/all/mean",
    "mismatch_kl/all/mean",
    # RL episodes (fnt.rollout.base.episode_metrics): how many, their turns, tool calls and
    # failed ones per episode, the ones cut by a limit, the ones out of turns; then each named
    # reward (reward/NAME/mean).
    "rollout/episodes",
    "rollout/turns/mean",
    "rollout/tool_calls/mean",
    "rollout/tool_errors/mean",
    "rollout/truncated_episodes",
    "rollout/max_turns_episodes",
)
ABSENT = "<absent>"
# Where Linux lists the file locks held on this machine (`lock_state`).
PROC_LOCKS = "/proc/locks"


@dataclass(frozen=True)
class RunView:
    """What a run directory held when it was read."""

    path: Path
    name: str
    config: Optional[dict]  # config.json; None when there is none
    rows: tuple[dict, ...]  # the complete rows of metrics.jsonl, in file order
    has_metrics: bool
    partial_line: bool  # the last line of metrics.jsonl was left out: not yet complete
    checkpoint_entries: tuple[tuple[str, bool], ...]  # (name, holds COMPLETE) in checkpoints/
    wandb_run_id: Optional[str]
    recorded_missing: tuple[int, ...] = ()  # metrics_missing.json's steps
    missing_file_problem: Optional[str] = None  # what is wrong with an unreadable one
    lock_holder: Optional[str] = None  # run.lock's text ("host H pid P"); None without the file
    lock_held: Optional[bool] = False  # whether a process holds run.lock now; None: unknowable


def read_run(path: Union[str, Path]) -> RunView:
    """Read a run directory; DataError when it is not one or one of its files is unreadable."""
    path = Path(path)
    require_dir(path, "", DataError, "a run directory")
    config_file, metrics_file = path / CONFIG_FILE, path / METRICS_FILE
    if not config_file.is_file() and not metrics_file.is_file():
        raise DataError(f"{path}: not a run directory (no {CONFIG_FILE} and no {METRICS_FILE})")
    config = _read_config(config_file) if config_file.is_file() else None
    rows, partial = [], False
    if metrics_file.is_file():
        rows, partial = parse_metrics(metrics_file.read_text(encoding="utf-8"), str(metrics_file))
    wandb_file = path / WANDB_ID_FILE
    recorded_missing, missing_file_problem = read_missing_steps(path / METRICS_MISSING_FILE)
    return RunView(
        path=path,
        # abspath, so that "." and "run/" are named too; it does not follow symlinks.
        name=Path(os.path.abspath(path)).name,
        config=config,
        rows=tuple(rows),
        has_metrics=metrics_file.is_file(),
        partial_line=partial,
        checkpoint_entries=tuple(sorted(list_step_dirs(ckpt_root(path)))),
        wandb_run_id=wandb_file.read_text().strip() if wandb_file.is_file() else None,
        recorded_missing=tuple(recorded_missing),
        missing_file_problem=missing_file_problem,
        **lock_state(path / LOCK_FILE),
    )


def lock_state(path: Path) -> dict[str, Any]:
    """`lock_holder` (the text of run.lock, None without it) and `lock_held`: whether a process
    holds the run's lock now. Asked without taking the lock (a run starting at that moment must
    not find it taken): the kernel lists the flock locks of this machine in /proc/locks by device
    and inode. A lock another machine holds on a shared disk is not listed there: when run.lock
    names another host, an unlisted lock is unknowable (None). Without /proc/locks (not Linux),
    the holder's pid is looked up instead, on this host only."""
    if not path.is_file():
        return {"lock_holder": None, "lock_held": False}
    try:
        holder = path.read_text(encoding="utf-8", errors="replace").strip()
        st = path.stat()
    except OSError:
        return {"lock_holder": None, "lock_held": None}
    fields = holder.split()
    host = fields[1] if len(fields) >= 4 and fields[0] == "host" and fields[2] == "pid" else None
    here = host is None or host == socket.gethostname()
    try:
        with open(PROC_LOCKS, encoding="ascii", errors="replace") as fh:
            listed = fh.read()
    except OSError:
        listed = None
    if listed is not None:
        held = flock_listed(listed, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        return {"lock_holder": holder, "lock_held": True if held else (False if here else None)}
    if host is None or not here or not fields[3].isdigit():
        return {"lock_holder": holder, "lock_held": None}
    return {"lock_holder": holder, "lock_held": _alive(int(fields[3]))}


def flock_listed(proc_locks: str, major: int, minor: int, inode: int) -> bool:
    """Whether the text of /proc/locks lists a flock lock held on the file (major:minor:inode,
    the device numbers in hex); a waiter's line (`->`) does not count. Pure."""
    wanted = f"{major:02x}:{minor:02x}:{inode}"
    for line in proc_locks.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
            return True
    return False


def _alive(pid: int) -> Optional[bool]:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OSError, ValueError, OverflowError):
        return None
    return True


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object, the resolved config")
    return config


def parse_metrics(text: str, source: str) -> tuple[list[dict], bool]:
    """The rows of a metrics.jsonl text, and whether its last line was left out. Pure.

    The writer appends a line and its newline in one write, so only the last line can be
    incomplete: without a newline it is still being written (or a crash cut it), and an
    unparsable one is what a crash leaves. Any other bad line raises DataError naming `source`.
    """
    lines = text.split("\n")
    # After a final newline the split ends in ""; otherwise it ends in the unfinished line.
    partial = bool(lines.pop().strip())
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    rows = []
    for index, (number, line) in enumerate(numbered):
        row = _row(line)
        if row is None:
            if index == len(numbered) - 1 and not partial:
                return rows, True
            raise DataError(
                f"{source}:{number}: not a metrics row (a JSON object with an integer 'step')"
            )
        rows.append(row)
    return rows, partial


def _row(line: str) -> Optional[dict]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def default_keys(present: Collection[str]) -> list[str]:
    """The key metrics among `present`, then its named rewards (`reward/NAME/mean`) and `val/*`
    keys, each sorted. Pure."""
    named = sorted(
        key
        for key in present
        if key.startswith("reward/") and key.endswith("/mean") and key.count("/") == 2
    )
    return (
        [key for key in KEY_METRICS if key in present]
        + named
        + sorted(key for key in present if key.startswith("val/"))
    )


def classify_checkpoints(entries: Collection[tuple[str, bool]]) -> dict[str, list]:
    """The entries of checkpoints/ as complete steps, `step_N.partial` names and the rest. Pure."""
    complete = complete_steps(entries)
    partial = [name for name, _ in entries if partial_step_of(name) is not None]
    counted = {step_name(step) for step in complete} | set(partial)
    return {
        "checkpoints": complete,
        "partial": sorted(partial, key=partial_step_of),
        "stray": sorted(name for name, _ in entries if name not in counted),
    }


def wall_time(rows: tuple[dict, ...]) -> Optional[float]:
    """Seconds from the start of the first step to the last row; None without times. Pure."""
    if not rows:
        return None
    first, last = rows[0].get("time"), rows[-1].get("time")
    if not isinstance(first, (int, float)) or not isinstance(last, (int, float)):
        return None
    # A row's time is taken when its step ends, so the first step's own duration is added.
    first_step = rows[0].get("time/step")
    return last - first + (first_step if isinstance(first_step, (int, float)) else 0.0)


def row_gaps(view: RunView) -> dict[str, list[int]]:
    """The missing and the duplicated steps of a run's rows (see the module docstring). Pure."""
    counts = Counter(row["step"] for row in view.rows)
    last = max(counts, default=0)
    missing = set(view.recorded_missing) | {s for s in range(1, last + 1) if s not in counts}
    return {
        "missing_steps": sorted(missing),
        "duplicated_steps": sorted(step for step, n in counts.items() if n > 1),
    }


def notes(view: RunView) -> list[str]:
    """What a reader of the summary should know about the files. Pure."""
    out = []
    if view.config is None:
        out.append(f"no {CONFIG_FILE}")
    if not view.has_metrics:
        out.append(f"no {METRICS_FILE}")
    if view.partial_line:
        out.append(
            f"the last line of {METRICS_FILE} is incomplete (the run is writing it, or a crash "
            "cut it short) and is left out"
        )
    if view.missing_file_problem:
        out.append(view.missing_file_problem)
    return out


def run_state(view: RunView, config: dict, kinds: dict[str, list]) -> dict[str, Any]:
    """`{"state", "text"}`: whether the run is running, finished, crashed or stopped, from what
    its directory holds (`config` flattened, `kinds` from classify_checkpoints). Pure.

    A run holds run.lock while it runs (an OS lock, released however the process ends), so a
    held lock is `running`. A run that is not running finished when its last row is step
    max_steps and, with ckpt.save_final, step_{max_steps} is complete. One that did not
    `stopped` when its last row's step is its newest complete checkpoint and nothing was left
    half-written (a preemption leaves that, and so does a crash before the next step wrote
    anything); otherwise it
    `crashed`: rows beyond the newest checkpoint, a `step_N.partial` or a torn last line.
    `unknown`: the lock is held on another machine's view of the disk (run.lock names another
    host), or there is no config.json to say how many steps were planned.
    """
    last = view.rows[-1]["step"] if view.rows else None
    max_steps = config.get("max_steps")
    holder = f" ({view.lock_holder})" if view.lock_holder else ""
    if view.lock_held:
        return {"state": "running", "text": f"running: a process holds {LOCK_FILE}{holder}"}
    complete, partial = kinds["checkpoints"], kinds["partial"]
    newest = max(complete, default=None)
    final_missing = config.get("ckpt.save_final", True) is not False and max_steps not in complete
    if not isinstance(max_steps, int) or isinstance(max_steps, bool):
        return {"state": "unknown", "text": f"unknown: no {CONFIG_FILE} says how many steps"}
    if last is not None and last >= max_steps and not final_missing:
        return {"state": "finished", "text": f"finished: all {max_steps} steps"}
    if view.lock_held is None:
        return {
            "state": "unknown",
            "text": f"not finished, and {LOCK_FILE} names another machine{holder}, which this "
            "one cannot ask: the run is running there, or it stopped",
        }
    nobody = f"no process holds {LOCK_FILE}"
    if last is None:
        return {
            "state": "crashed",
            "text": f"crashed before its first step ended (no row; {nobody})",
        }
    if last >= max_steps:
        where = f"while saving the final checkpoint step_{last}"
    elif step_name(last) + ".partial" in partial:
        where = f"while saving the checkpoint after step {last}"
    elif newest == last and not partial and not view.partial_line:
        return {
            "state": "stopped",
            "text": f"stopped after step {last} of {max_steps}, its checkpoint step_{last} "
            f"complete: preempted, or it crashed in step {last + 1} before writing anything "
            f"({nobody})",
        }
    else:
        where = f"in step {last + 1} of {max_steps}"
    return {
        "state": "crashed",
        "text": f"crashed {where}: the last row is step {last}; {nobody}",
    }


def summary(view: RunView) -> dict[str, Any]:
    """The fields of `fnt inspect --json` (listed in the module docstring) for a run. Pure."""
    config = flatten(view.config) if view.config is not None else {}
    last = view.rows[-1] if view.rows else {}
    kinds = classify_checkpoints(view.checkpoint_entries)
    newest = max(kinds["checkpoints"], default=None)
    beyond = [row["step"] for row in view.rows if newest is None or row["step"] > newest]
    state = run_state(view, config, kinds)
    return {
        "run": view.name,
        "path": str(view.path),
        "model": config.get("model.name"),
        "step": last.get("step"),
        "max_steps": config.get("max_steps"),
        "metrics": {key: last[key] for key in default_keys(last.keys())},
        "num_tokens": _count(last.get("progress/num_tokens")),
        "num_samples": _count(last.get("progress/num_samples")),
        "wall_time_s": wall_time(view.rows),
        **kinds,
        "best_checkpoint": best_of(config.get("ckpt.keep_best"), view.rows, kinds["checkpoints"]),
        "rows_beyond_checkpoint": (
            {"first": beyond[0], "last": beyond[-1], "checkpoint": newest} if beyond else None
        ),
        **row_gaps(view),
        "wandb_run_id": view.wandb_run_id,
        "state": state["state"],
        "state_text": state["text"],
        "notes": notes(view),
    }


def best_of(keep_best: Any, rows: list[dict], checkpoints: list[int]) -> Optional[dict]:
    """The best checkpoint under the run's ckpt.keep_best (fnt.store.best), as a dict; None
    when the run keeps no best or no checkpoint's row has the key. Pure."""
    if not isinstance(keep_best, str) or not keep_best:
        return None
    best = best_step({row["step"]: row for row in rows}, checkpoints, keep_best)
    return None if best is None else best.as_dict()


def _count(value: Any) -> Any:
    # Counts are logged as floats (every metric is); a whole number reads better as an int.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def config_diff(a: dict, b: dict) -> dict[str, list]:
    """`{dotted key: [a's value, b's value]}` where they differ, ABSENT for a missing key. Pure."""
    flat_a, flat_b = flatten(a), flatten(b)
    return {
        key: [flat_a.get(key, ABSENT), flat_b.get(key, ABSENT)]
        for key in sorted(flat_a.keys() | flat_b.keys())
        if flat_a.get(key, ABSENT) != flat_b.get(key, ABSENT)
    }


def format_summary(s: dict[str, Any]) -> str:
    """The text `fnt inspect` prints for a summary dict. Pure."""
    metrics = "  ".join(f"{key} {_number(value)}" for key, value in s["metrics"].items())
    lines = [
        f"run          {s['run']} ({s['path']})",
        f"model        {_text(s['model'])}",
        f"steps        {_text(s['step'])} / {_text(s['max_steps'])}",
        f"state        {s['state_text']}",
        f"metrics      {metrics or '-'}",
        f"seen         {_text(s['num_tokens'])} tokens, {_text(s['num_samples'])} samples",
        f"wall time    {_duration(s['wall_time_s'])}",
        "checkpoints  " + (", ".join(map(step_name, s["checkpoints"])) or "none"),
    ]
    best = s["best_checkpoint"]
    if best:
        lines.append("best         " + Best(**best).text() + " (ckpt.keep_best; never pruned)")
    if s["partial"]:
        lines.append(f"partial      {', '.join(s['partial'])} (incomplete; resume ignores these)")
    if s["stray"]:
        stray = ", ".join(s["stray"])
        lines.append(f"stray        {stray} (not checkpoints; resume ignores these)")
    beyond = s["rows_beyond_checkpoint"]
    if beyond:
        where = (
            "any checkpoint (none is complete)"
            if beyond["checkpoint"] is None
            else f"the newest checkpoint step_{beyond['checkpoint']}"
        )
        lines.append(
            f"beyond       rows {beyond['first']}..{beyond['last']} are beyond {where}; "
            "a resume redoes them"
        )
    if s["missing_steps"]:
        lines.append(f"missing      no row for steps {step_ranges(s['missing_steps'])}")
    if s["duplicated_steps"]:
        lines.append(
            f"duplicated   steps {step_ranges(s['duplicated_steps'])} have more than one row "
            "(a resume keeps the last)"
        )
    if s["wandb_run_id"]:
        lines.append(f"wandb        run id {s['wandb_run_id']}")
    lines += [f"note         {note}" for note in s["notes"]]
    if "config_diff" in s:
        diff = s["config_diff"]
        lines.append(f"config diff  against {diff['other']}: {len(diff['keys'])} keys differ")
        lines += [f"  {key}: {a!r} -> {b!r}" for key, (a, b) in diff["keys"].items()]
    return "\n".join(lines)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" + (f" ({seconds / 3600:.1f} h)" if seconds >= 3600 else "")


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _number(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fnt inspect", description="Summarize a run directory: progress, metrics, checkpoints."
    )
    parser.add_argument(
        "run", type=Path, metavar="RUN", help="a run directory (the output_dir of a run)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--diff", type=Path, metavar="OTHER_RUN", help="compare the configs")
    args = parser.parse_args(argv)
    view = read_run(args.run)
    s = summary(view)
    if args.diff is not None:
        other = read_run(args.diff)
        for run in (view, other):
            if run.config is None:
                raise DataError(f"{run.path}: no {CONFIG_FILE} to compare")
        s["config_diff"] = {
            "other": str(other.path),
            "keys": config_diff(view.config, other.config),
        }
    print(json.dumps(s) if args.json else format_summary(s))
