"""Argparse types that check a flag's range as it is parsed.

Each type is a callable value that reads one flag's text and raises
`argparse.ArgumentTypeError` with the allowed range when the value is outside
it, so argparse reports `argument --flag: must be ...` before any work starts.
`str(kind)` is the range in words: put `%(type)s` in a flag's help to show it
in `--help`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.memory import gib
from flowmoe.core.policy import check_defer, parse_bytes
from flowmoe.core.spec import ModelSpec


@frozen
class IntRange:
    """An integer in [low, high] (high None: no upper bound)."""

    low: int
    high: int | None = None

    def __call__(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}") from None
        if value < self.low or (self.high is not None and value > self.high):
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
        return value

    def __str__(self) -> str:
        if self.high is None:
            return f"an integer >= {self.low}"
        return f"an integer in [{self.low}, {self.high}]"


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


@frozen
class ByteSize:
    """A size such as 16GiB, 24GB or 512MiB of at least `minimum` bytes."""

    minimum: int = 1

    def __call__(self, text: str) -> int:
        try:
            value = parse_bytes(text) if text.strip() else None
        except ConfigError:
            value = None
        if value is None or value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
        return value

    def __str__(self) -> str:
        least = "more than 0 bytes" if self.minimum <= 1 else f"at least {size_flag(self.minimum)}"
        return f"a size such as 16GiB, 24GB or 512MiB, {least}"


POSITIVE_INT = IntRange(1)
NON_NEGATIVE_INT = IntRange(0)
FRACTION = FloatRange(0.0, 1.0)
BYTES = ByteSize()
PAGE_SIZE = ByteSize(64 * 2**10)  # smaller pages only multiply nodes: a 1B page is a million per expert


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


MAX_PAGES_PER_EXPERT = 256  # a paged expert is one copy node per page: bound the nodes of a step


def check_page_size(page_bytes: int, expert_bytes: int) -> None:
    """--page-size against the model: at most MAX_PAGES_PER_EXPERT pages per expert."""
    pages = -(-expert_bytes // page_bytes)
    if pages > MAX_PAGES_PER_EXPERT:
        least = -(-expert_bytes // MAX_PAGES_PER_EXPERT // 2**16) * 2**16  # rounded up to 64 KiB
        raise ConfigError(
            f"--page-size {size_flag(page_bytes)} cuts each expert ({gib(expert_bytes)}) into {pages} "
            f"pages; at most {MAX_PAGES_PER_EXPERT} are allowed: use --page-size {size_flag(least)} or more"
        )


def size_flag(n: int) -> str:
    """Bytes as a flag value: 64KiB, 16MiB, 1344KiB (the largest unit that divides n)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


EXPERT_FORMAT_HELP = (
    "how offloaded experts cross the link: native (the model's dtype) or fp8 (an FP8 checkpoint's "
    "e4m3 values and block scales, dequantized on the GPU after the copy: half the bytes of bf16)"
)

DEFER_EXPERTS_HELP = (
    "ktransformers only: KTransformers' Expert Deferral, experts per token whose output goes into the "
    "next layer so the CPU computes them during its attention (%(type)s; 0: none). K > 0 CHANGES THE "
    "MODEL'S OUTPUTS (not eager's tokens; the paper reports <= 0.5%% accuracy drop)"
)
DEFERRING_SCHEDULER = "ktransformers"


def check_deferral(defer: int, schedulers: Sequence[str], spec: ModelSpec | None = None) -> None:
    """--defer-experts is ktransformers' alone (it changes outputs) and below the model's top-k."""
    others = [name for name in schedulers if name != DEFERRING_SCHEDULER]
    if defer and others:
        raise ConfigError(
            f"--defer-experts is ktransformers' Expert Deferral (it changes the outputs); scheduler "
            f"{others[0]} does not take it: use --scheduler ktransformers or leave --defer-experts out"
        )
    if spec is not None:
        check_defer(defer, spec.moe.top_k)
