"""A command's write guard (flowmoe/core/write_guard.py) from its flags: the files it reads, the
files it writes, and `--force`."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from flowmoe.core.write_guard import Guard, Named, OutputKind, Target

FORCE_HELP = (
    "replace an existing output file that flowmoe did not write (never a file the command reads, "
    "another of its outputs, or anything but a regular file)"
)
INPUT_FLAGS = {  # the flags that may name a file the command reads, and the file in words
    "prompts": "the prompt file",
    "routing": "the --routing trace",
    "routing_profile": "the --routing-profile trace",
    "hardware": "the --hardware profile",
}


def add_force_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)


def write_guard(
    args: argparse.Namespace, outputs: list[tuple[str, Path | None, OutputKind | None]], *reads: Named
) -> Guard:
    """The guard of a command writing `outputs` ((flag, path or None when not given, kind)), checked
    before any work starts: it reads the files its flags name, a checkpoint's files, and `reads`."""
    targets = tuple(Target(flag, path, kind) for flag, path, kind in outputs if path is not None)
    guard = Guard((*_inputs(args), *reads), targets, args.force)
    guard.check_all()
    return guard


def _inputs(args: argparse.Namespace) -> Iterator[Named]:
    given = vars(args)
    for name, role in INPUT_FLAGS.items():
        if given.get(name) is not None and os.path.isfile(given[name]):
            yield Named(role, Path(given[name]))
    model = given.get("model")
    if model is not None and os.path.isdir(model):
        yield from _checkpoint_files(Path(model))


def _checkpoint_files(folder: Path) -> Iterator[Named]:
    """Every regular file of the folder; what cannot be listed or followed is skipped (the
    command's own reading of the checkpoint names the problem)."""
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file():
                    yield Named("a file of the checkpoint", Path(entry.path))
