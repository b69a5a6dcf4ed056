"""A monitor of a user's own, for tests/fnt/test_monitors.py: it appends what it is told to
{output_dir}/recorded.jsonl, so a test can read it after the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fnt.config import Config


class RecordingMonitor:
    def __init__(self, config: Config, start_step: int) -> None:
        self.path = Path(config.output_dir) / "recorded.jsonl"
        self.write({"event": "open", "start_step": start_step})

    def write(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def resume(self, start_step: int, rows) -> None:
        steps = [row["step"] for row in rows(range(1, start_step + 1))]
        self.write({"event": "resume", "start_step": start_step, "read_back": steps})

    def log(self, row: Mapping[str, Any]) -> None:
        self.write({"event": "log", "step": row["step"]})

    def close(self) -> None:
        self.write({"event": "close"})


class BrokenMonitor:
    def __init__(self, config: Config, start_step: int) -> None:
        raise RuntimeError("this monitor cannot start")


def recorded(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "recorded.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
