"""Argparse types that check a flag's range as it is parsed.

Each type is a callable value that reads one flag's text and raises
`argparse.ArgumentTypeError` with the allowed range when the value is outside
it, so argparse reports `argument --flag: must be ...` before any work starts.
`str(kind)` is the range in words: put `%(type)s` in a flag's help to show it
in `--help`. The integer and size ranges are `flowmoe.core.ranges`' (a scheduler's
options fields are checked with them too).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from attrs import frozen

from flowmoe.core.ranges import ByteSize, IntRange


@frozen
class FloatRange:
    """A finite number between low and high; `low_open` excludes low itself."""

    low: float
    high: float = math.inf
    low_open: bool = False

    def __call__(self, text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}") from None
        below = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or below or value > self.high:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
        return value

    def __str__(self) -> str:
        if math.isinf(self.high):
            return f"a number {'>' if self.low_open else '>='} {self.low:g}"
        return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


POSITIVE_INT = IntRange(1)
NON_NEGATIVE_INT = IntRange(0)
FRACTION = FloatRange(0.0, 1.0)
BYTES = ByteSize()


@frozen
class OutputFile:
    """A file flowmoe will write: not a folder, in a folder that exists and can be written."""

    def __call__(self, text: str) -> Path:
        path = Path(text)
        if not text.strip() or path.is_dir():
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r} (a folder)")
        folder = path.parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"must be {self}; folder {str(folder)!r} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"must be {self}; {text!r} cannot be written (permission)")
        return path

    def __str__(self) -> str:
        return "a file path in an existing, writable folder"


OUTPUT_FILE = OutputFile()


@frozen
class TokensOrSize:
    """A positive token count (a plain integer) or a size such as 64MiB; returned as written."""

    def __call__(self, text: str) -> str:
        try:
            POSITIVE_INT(text) if text.strip().isdigit() else BYTES(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}") from None
        return text.strip()

    def __str__(self) -> str:
        return "tokens (an integer >= 1) or a size such as 64MiB"


TOKENS_OR_SIZE = TokensOrSize()


EXPERT_FORMAT_HELP = (
    "how experts are kept in host memory and cross the link, dequantized on the GPU after the copy "
    "(on the CPU per call): native (the model's dtype); fp8 (an FP8 checkpoint's e4m3 values and block "
    "scales: half the bytes of bf16); or quantized as a bf16/fp16/fp32 model loads: int8 (per channel, "
    "~1 byte per weight), int4 (groups of 128, round to nearest, ~0.53 bytes per weight) or hqq4 (HQQ, "
    "groups of 64, ~0.56 bytes per weight); a quantized run reports the logits' error it introduced"
)
ATTENTION_FORMAT_HELP = (
    "how each layer's attention projections (q/k/v and o) are kept where the layer's dense part is "
    "offloaded (Klotski(q)): native, or quantized as a bf16/fp16/fp32 model loads to int8, int4 or hqq4 "
    "(the layouts of --expert-format); `run` computes them on the CPU from the packed bytes (int8 "
    "activations) and keeps and copies them dequantized in the model's dtype for a GPU; `simulate`/`plan` "
    "price the packed bytes; grouped-query attention only"
)
