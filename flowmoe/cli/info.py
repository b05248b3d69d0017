"""`flowmoe presets` and `flowmoe schedulers`: what is built in, one line each."""

from __future__ import annotations

import argparse

from rich.table import Table

from flowmoe.cli.ui import out
from flowmoe.core.presets import PRESETS, preset
from flowmoe.schedulers.registry import available


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("presets", help="paper-model presets (random weights, real shapes)").set_defaults(
        handler=_presets
    )
    sub.add_parser("schedulers", help="the registered scheduler plugins").set_defaults(handler=_schedulers)


def _presets(_args: argparse.Namespace) -> int:
    table = Table(title="presets")
    for column in ("name", "family", "layers", "hidden", "experts", "top-k", "params (B)"):
        table.add_column(column)
    for name in PRESETS:
        s = preset(name)
        params = s.total_bytes / s.dtype_bytes / 1e9
        table.add_row(
            name,
            s.family,
            str(s.layers),
            str(s.hidden),
            str(s.moe.experts),
            str(s.moe.top_k),
            f"{params:.1f}",
        )
    out.print(table)
    return 0


def _schedulers(_args: argparse.Namespace) -> int:
    table = Table(title="schedulers (--scheduler NAME)")
    table.add_column("name")
    table.add_column("what it does")
    for name, cls in available().items():
        table.add_row(name, cls.summary)
    out.print(table)
    return 0
