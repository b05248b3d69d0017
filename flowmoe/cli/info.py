"""`flowmoe presets` and `flowmoe schedulers`: what is built in, one line each."""

from __future__ import annotations

import argparse

from rich.markup import escape

from flowmoe.cli.ui import out, table
from flowmoe.core.presets import PRESETS, preset


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("presets", help="paper-model presets (random weights, real shapes)").set_defaults(
        handler=_presets
    )
    sub.add_parser("schedulers", help="the registered scheduler plugins").set_defaults(handler=_schedulers)


def _presets(_args: argparse.Namespace) -> int:
    presets = table(
        "presets", ("name", "family", "layers", "hidden", "experts", "top-k", "params\n(B)"), "right"
    )
    for name in PRESETS:
        s = preset(name)
        params = s.total_bytes / s.dtype_bytes / 1e9
        presets.add_row(
            name,
            s.family,
            str(s.layers),
            str(s.hidden),
            str(s.moe.experts),
            str(s.moe.top_k),
            f"{params:.1f}",
        )
    out.print(presets)
    return 0


def _schedulers(_args: argparse.Namespace) -> int:
    from flowmoe.schedulers.registry import available, broken  # loads every plugin: not for presets

    schedulers = table("schedulers (--scheduler NAME)", ("name", "what it does"), prose=("what it does",))
    for name, cls in available().items():
        schedulers.add_row(name, cls.summary)
    for name, error in broken().items():
        schedulers.add_row(name, f"[red]broken:[/] {escape(error)}")
    out.print(schedulers)
    return 0
