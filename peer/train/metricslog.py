"""A JSONL metrics log: one JSON object per line, flushed as written, so a crash loses at most one line."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Self


class MetricsLog:
    """Append-only JSONL writer; every record gets a wall-clock ``time`` field."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file = None
        self._lock = threading.Lock()  # a stage peer's round reports come from a worker thread beside its steps
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"time": round(time.time(), 3), **fields}) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
