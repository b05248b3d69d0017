"""Reading a JSON file that must hold an object, with one error line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowmoe.core.errors import ConfigError, FlowmoeError


def read_json_object(path: Path, error: type[FlowmoeError] = ConfigError) -> dict[str, Any]:
    if not path.is_file():
        raise error(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data
