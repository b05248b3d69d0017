"""Shared rich console, tables and progress of the command line.

Progress and status only show on a terminal (piped, they would leave blank
lines); tables fold long cells instead of cutting them, and never cut the
first column (names a user types back)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)
out = Console()
NO_GPU = "no GPU: the gpu.* lanes were emulated on the CPU (same names, CPU kernels)"


def progress(*extra_columns) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
        TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal,
    )  # fmt: skip


class Spinner(Protocol):
    def update(self, text: str, /) -> None: ...


class _Quiet:
    def update(self, _status: str) -> None:
        pass


@contextmanager
def status(text: str) -> Iterator[Spinner]:
    """A spinner with `update(text)` on a terminal; nothing otherwise."""
    if not console.is_terminal:
        yield _Quiet()
        return
    with console.status(text) as spinner:
        yield spinner


def table(title: str, columns: tuple[str, ...], justify: Literal["left", "right"] = "left") -> Table:
    """A table whose first column never wraps and whose other cells fold rather than truncate."""
    result = Table(title=title)
    result.add_column(columns[0], justify=justify, no_wrap=True)
    for column in columns[1:]:
        result.add_column(column, justify=justify, overflow="fold")
    return result
