"""Ranges of integer values, each usable two ways: `contains(value)` checks a value in code (an
options field's validator, `core.options`), and calling it on a flag's text parses that text as an
argparse type, raising `argparse.ArgumentTypeError` with the range when it is outside. `str(range)`
is the range in words, for messages and `--help` (`%(type)s`)."""

from __future__ import annotations

import argparse

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.policy import parse_bytes


@frozen
class IntRange:
    """An integer in [low, high] (high None: no upper bound)."""

    low: int
    high: int | None = None

    def contains(self, value: int) -> bool:
        return self.low <= value and (self.high is None or value <= self.high)

    def __call__(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
        return value

    def __str__(self) -> str:
        if self.high is None:
            return f"an integer >= {self.low}"
        return f"an integer in [{self.low}, {self.high}]"


@frozen
class ByteSize:
    """A size such as 16GiB, 24GB or 512MiB of at least `minimum` bytes."""

    minimum: int = 1

    def contains(self, value: int) -> bool:
        return value >= self.minimum

    def __call__(self, text: str) -> int:
        try:
            value = parse_bytes(text) if text.strip() else None
        except ConfigError:
            value = None
        if value is None or not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
        return value

    def __str__(self) -> str:
        least = "more than 0 bytes" if self.minimum <= 1 else f"at least {size_flag(self.minimum)}"
        return f"a size such as 16GiB, 24GB or 512MiB, {least}"


def size_flag(n: int) -> str:
    """Bytes as a flag value: 64KiB, 16MiB, 1344KiB (the largest unit that divides n)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
