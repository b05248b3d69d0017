"""What produced a results log, kept beside it so a resume cannot mix experiments.

`run --output NAME` writes `.NAME.run.json` next to the log (through the write guard, marked as
flowmoe's): the model's identity (a hash of config.json and the shards' names and sizes, --dtype,
--layers) and every setting that changes a result (max_new_tokens, sampling, stop strings, the chat
template). A resume whose settings differ from the record is refused with one line naming the
first difference, before anything is generated; `--force` appends anyway (and records the new
settings), a new `--output` starts a new experiment. A log without a record (an older flowmoe, or a
deleted record) is resumed and given one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowmoe.core.bounded_read import CONFIG, read_bounded
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.core.write_guard import Guard, Named, OutputKind, Target

RUN_FORMAT = "flowmoe-run/1"
RUN_RECORD = OutputKind("run record", f'{{"format": "{RUN_FORMAT}"'.encode())

TEMPLATE_FILE = "chat_template.jinja"
Settings = Mapping[str, Any]  # name -> a JSON value


def record_file(output: Path) -> Path:
    """The record beside a results log: `.NAME.run.json`."""
    return output.parent / f".{output.name}.run.json"


def model_identity(source: str | Path, dtype: str | None, layers: int | None) -> dict[str, Any]:
    """The model as far as a result depends on it: config.json's hash, the shards' names and
    sizes (hashing gigabytes of weights would cost minutes), and the flags that change them."""
    folder = Path(source)
    shards = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors"))
    tokenizer = folder / "tokenizer.json"
    return {
        "model config.json sha256": _file_hash(folder / "config.json"),
        "model shards": [f"{name}:{size}" for name, size in shards],
        "tokenizer.json bytes": tokenizer.stat().st_size if tokenizer.is_file() else None,
        "chat template sha256": [_file_hash(folder / n) for n in ("tokenizer_config.json", TEMPLATE_FILE)],
        "--dtype": dtype,
        "--layers": layers,
    }


def _file_hash(path: Path) -> str | None:
    """The first 16 hex digits of a small file's sha256 (read with its bound), None if absent."""
    if not path.is_file():
        return None
    return hashlib.sha256(read_bounded(path, CONFIG)).hexdigest()[:16]


def check_and_record(
    output: Path,
    prompts: Path,
    settings: Settings,
    has_results: bool,
    force: bool,
    notes: Settings | None = None,
) -> None:
    """Refuse a resume of `output` (it `has_results`) made with other `settings` than its record's
    (unless `force`), then write this run's record, with `notes` beside the settings (what this run
    measured of itself, e.g. the error its quantized experts introduced: never compared)."""
    path = record_file(output)
    guard = Guard((Named("the prompt file", prompts),), (Target("--output", output, None),), force)
    if has_results and not force and (path.exists() or path.is_symlink()):
        recorded = read_json_object(path, FlowmoeError)
        if recorded.get("format") != RUN_FORMAT:
            raise FlowmoeError(f"{path}: not a flowmoe run record; it is left as it is: use another --output")
        difference = first_difference(recorded.get("settings", {}), settings)
        if difference is not None:
            raise FlowmoeError(
                f"--output {output}: its results were produced with {difference}; resuming would mix two "
                "experiments: use a new --output, or --force to append anyway"
            )
    record = {"format": RUN_FORMAT, "settings": dict(settings), **(notes or {})}  # RUN_RECORD's marker first
    text = json.dumps(record) + "\n"

    def produce(tmp: Path) -> None:
        tmp.write_text(text)

    guard.write(path, RUN_RECORD, produce)


def first_difference(recorded: Any, current: Settings) -> str | None:
    """'NAME A, this run NAME B' for the first setting that differs, or None."""
    if not isinstance(recorded, dict):
        return "settings that cannot be read"
    for name, value in current.items():
        old = recorded.get(name)
        if _json(old) != _json(value):
            return f"{name} {_shown(old)}, this run has {_shown(value)}"
    return None


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _shown(value: Any) -> str:
    text = _json(value)
    return text if len(text) <= 80 else text[:77] + "..."
