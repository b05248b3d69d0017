"""Shared rich console and progress bars of the command line."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(stderr=True)
out = Console()


def progress(*extra_columns) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
        TimeRemainingColumn(), console=console, transient=True,
    )  # fmt: skip
