"""Shared rich console, tables and progress of the command line.

Progress bars and spinners only show on a terminal (piped, they would leave
blank lines); a long study piped says a line per finished step on stderr
instead (`steps`). Tables are made to be read at 80 columns and in a file:
names and numbers never wrap (a cut would change them), only prose columns
wrap, at words; the details a table leaves out are in the command's --json."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class _Console(Console):
    """A console that never cuts a table: one narrower than the table's least width (its names and
    numbers whole) gets lines as long as the table needs (a terminal wraps them, a file keeps them)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        tables = [o for o in objects if isinstance(o, Table)]
        if tables and kwargs.get("width") is None:
            roomy = self.options.update_width(1 << 16)  # measured unbounded: the table's own least width
            need = max(self.measure(t, options=roomy).minimum for t in tables)
            if need > self.width:  # rich caps print(width=) at the console's: widen the console itself
                kept, self._width = self._width, need
                try:
                    return super().print(*objects, **kwargs)
                finally:
                    self._width = kept
        return super().print(*objects, **kwargs)


console = _Console(stderr=True)
out = _Console()
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


@contextmanager
def steps(description: str, total: int) -> Iterator[Callable[[str], None]]:
    """A long study's progress: yields `done(what)`, called as each of `total` steps finishes. On a
    terminal a progress bar; piped, one line per finished step on stderr (`[3/13] fiddler 4.2 s`)."""
    if console.is_terminal:
        with progress() as bar:
            task = bar.add_task(description, total=total)
            yield lambda _what: bar.advance(task)
        return
    count, last = 0, time.perf_counter()

    def done(what: str) -> None:
        nonlocal count, last
        count, now = count + 1, time.perf_counter()
        console.print(f"[{count}/{total}] {what} {now - last:.1f} s", markup=False, highlight=False)
        last = now

    yield done


def table(
    title: str,
    columns: Sequence[str],
    justify: Literal["left", "right"] = "left",
    prose: Sequence[str] = (),
) -> Table:
    """A table legible at 80 columns: no cell wraps (names and numbers stay whole) but those of the
    `prose` columns, which wrap at words; headers may break at their spaces."""
    result = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                   title_justify="left", caption_justify="left")  # fmt: skip
    for i, column in enumerate(columns):
        wrap = column in prose
        side: Literal["left", "right"] = "left" if i == 0 or wrap else justify
        result.add_column(column, justify=side, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis")
    return result
