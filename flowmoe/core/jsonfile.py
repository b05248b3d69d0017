"""Reading a JSON file that must hold an object, with one error line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowmoe.core.bounded_read import CONFIG, Bound, read_bounded
from flowmoe.core.errors import ConfigError, FlowmoeError


def read_json_object(
    path: Path, error: type[FlowmoeError] = ConfigError, bound: Bound = CONFIG
) -> dict[str, Any]:
    """The JSON object in the file (a regular file of at most `bound`), or one error line naming it."""
    raw = read_bounded(path, bound, error)
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
    except ValueError as exc:  # an integer of more digits than Python converts
        raise error(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found a {_json_kind(data)}")
    return data


def _json_kind(data: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
