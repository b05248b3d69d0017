"""A checkpoint's `generation_config.json` (issue 27, item 8): its end-of-sequence ids and the
sampling its authors recommend, as transformers' `generate()` reads them.

transformers samples only when the file says `do_sample: true`; then a field left out takes
transformers' default (temperature 1.0, top_p 1.0, top_k 50). Without `do_sample: true` decoding
is greedy, whatever temperature the file names. `flowmoe run` starts from these and each flag given
overrides its field. The file is read bounded, as config.json is; a field of the wrong kind is one
error line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.jsonfile import read_json_object

FILE = "generation_config.json"
HF_TEMPERATURE, HF_TOP_P, HF_TOP_K = 1.0, 1.0, 50  # transformers' GenerationConfig defaults


@frozen
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = HF_TEMPERATURE
    top_p: float = HF_TOP_P
    top_k: int = HF_TOP_K

    def sampling(self) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) as flowmoe's sampler takes them: temperature 0 is greedy,
        top_k 0 no cut."""
        if not self.do_sample:
            return 0.0, 1.0, 0
        return self.temperature, self.top_p, self.top_k


def read_generation_config(folder: str | Path) -> GenerationConfig | None:
    """The folder's generation_config.json, or None where it has none."""
    path = Path(folder) / FILE
    if not path.exists() and not path.is_symlink():
        return None
    data = read_json_object(path)

    def number(key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: {key} must be a number, found {value!r:.60}")
        if value < low or value > high or (low_open and value == low):
            raise ConfigError(f"{path}: {key} {value} is out of range")
        return float(value)

    do_sample = data.get("do_sample", False)
    if not isinstance(do_sample, bool | None):
        raise ConfigError(f"{path}: do_sample must be true or false, found {do_sample!r:.60}")
    top_k = number("top_k", HF_TOP_K, 0, 2**31)
    if top_k != int(top_k):
        raise ConfigError(f"{path}: top_k must be an integer, found {top_k}")
    return GenerationConfig(
        eos_ids(data.get("eos_token_id"), path),
        bool(do_sample),
        number("temperature", HF_TEMPERATURE, 0.0, float("inf")),
        number("top_p", HF_TOP_P, 0.0, 1.0, low_open=True),
        int(top_k),
    )


def eos_ids(value: Any, where: Path) -> tuple[int, ...]:
    """An eos_token_id field (an id, a list of ids or null) as a tuple of ids."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of them, found {value!r:.60}")
    return tuple(values)
