"""Reading JSON: every JSON text flowmoe reads (a config, a prompt line, a results line, a trace)
goes through `parse_json`, so a malformed document, one nested too deeply, an integer of more
digits than Python converts or (where asked) a repeated key is one `JsonProblem` with a short
reason, never a traceback; and a JSON file that must hold an object is read with one error line
naming the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flowmoe.core.bounded_read import CONFIG, Bound, read_bounded
from flowmoe.core.errors import ConfigError, FlowmoeError


class JsonProblem(ValueError):
    """What is wrong with a JSON text, in words (the caller names the file and line)."""


def parse_json(text: str, unique_keys: bool = False) -> Any:
    """The JSON value in `text`; a JsonProblem when it is not valid JSON, is nested too deeply,
    holds an integer of more than Python's digit limit or (`unique_keys`) an object with a key
    given twice, which JSON leaves ambiguous."""
    try:
        return json.loads(text, object_pairs_hook=_unique if unique_keys else None)
    except json.JSONDecodeError as exc:
        raise JsonProblem(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except RecursionError as exc:
        raise JsonProblem("JSON nested too deeply") from exc
    except JsonProblem:
        raise
    except ValueError as exc:  # an integer of more digits than Python converts
        raise JsonProblem(f"not valid JSON: an integer of more than {_digit_limit()} digits") from exc


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise JsonProblem(f"the key {json.dumps(key)[:60]} is given twice")
        data[key] = value
    return data


def _digit_limit() -> int:
    return sys.get_int_max_str_digits() or 4300


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
        data = parse_json(text, unique_keys=True)
    except JsonProblem as exc:
        raise error(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found a {_json_kind(data)}")
    return data


def _json_kind(data: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
