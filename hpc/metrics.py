"""Per-step metrics as JSON lines in the run directory: one object per step, easy to tail and plot."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType


class MetricsLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, record: dict[str, object]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
