"""Reading a JSON file that must hold an object, with one error line naming the file."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from flowmoe.core.errors import ConfigError, FlowmoeError

OS_REASONS = {
    errno.ENOENT: "no such file",
    errno.EISDIR: "is a directory, not a file",
    errno.ELOOP: "a symlink loop",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file is in the way of a folder",
    errno.EEXIST: "a file is in the way of a folder",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the disk",
}


def os_reason(exc: OSError) -> str:
    """An OSError as a few words for an error line (the path is the caller's to name)."""
    return OS_REASONS.get(exc.errno or 0, exc.strerror or str(exc))


def read_bytes(path: Path, error: type[FlowmoeError] = ConfigError) -> bytes:
    """The file's bytes, or one error line naming it: missing, a directory, a loop, unreadable."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: {os_reason(exc)}") from exc


def read_json_object(path: Path, error: type[FlowmoeError] = ConfigError) -> dict[str, Any]:
    raw = read_bytes(path, error)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except RecursionError as exc:
        raise error(f"{path}: JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found a {_json_kind(data)}")
    return data


def _json_kind(data: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
