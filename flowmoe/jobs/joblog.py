"""The output JSONL of a job: appended one whole line per finished request, resumable.

Re-opening a log reads the ids already done and cuts off a torn last line
(a crash mid-write), so re-running the same command continues the job and
never duplicates or corrupts a result.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from attrs import define, field

from flowmoe.core.errors import FlowmoeError


@define
class JobLog:
    path: Path
    done: set[str] = field(factory=set)
    _fd: int | None = None

    @classmethod
    def open(cls, path: str | Path) -> JobLog:
        log = cls(Path(path))
        log.path.parent.mkdir(parents=True, exist_ok=True)
        if log.path.exists():
            log._recover()
        log._fd = os.open(log.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return log

    def _recover(self) -> None:
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            with self.path.open("r+b") as handle:  # drop the torn tail of an interrupted write
                handle.truncate(len(whole))
        for number, line in enumerate(whole.splitlines(), start=1):
            try:
                self.done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise FlowmoeError(
                    f"{self.path}:{number}: existing output line is not a result ({exc})"
                ) from exc

    def append(self, record: dict[str, Any]) -> None:
        """Write one result as a single line with one write call, then flush it to disk."""
        assert self._fd is not None, "log is closed"
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):
            raise FlowmoeError(f"{self.path}: short write ({written} of {len(line)} bytes)")
        os.fsync(self._fd)
        self.done.add(str(record["id"]))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
