"""`flowmoe calibrate`: measure this machine and save a hardware profile for --hardware PATH."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from flowmoe.cli.plan import spec_from
from flowmoe.cli.ui import console, out
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.hardware import save_profile


def register(sub: argparse._SubParsersAction) -> None:
    calibrate = sub.add_parser(
        "calibrate", help="measure this machine's flop/s and bandwidths into a profile"
    )
    calibrate.add_argument("--output", type=Path, default=Path("hardware.json"), help="profile JSON to write")
    calibrate.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    calibrate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    calibrate.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: ignore CUDA")
    calibrate.add_argument(
        "--model", help="measure the matmul and attention shapes of this preset or checkpoint"
    )
    calibrate.add_argument("--threads", type=int, help="torch threads per op (match the runs' --cpu-threads)")
    calibrate.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from flowmoe.study.calibrate import Shapes, calibrate

    if args.threads is not None:
        if args.threads < 1:
            raise FlowmoeError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    shapes = (
        Shapes.of(spec_from(argparse.Namespace(model=args.model, layers=None, dtype=None)))
        if args.model
        else None
    )
    with console.status("calibrating") as status:
        spec, measurements = calibrate(
            args.quick, args.dtype, lambda step: status.update(step), args.device, shapes
        )
    save_profile(spec, args.output)
    table = Table(title=f"calibration of {spec.name}")
    for column in ("measurement", "value", "unit"):
        table.add_column(column, justify="right")
    for m in measurements:
        table.add_row(m.name, f"{m.value:.3g}", m.unit)
    table.caption = spec.source
    out.print(table)
    out.print(f"profile: {args.output} (use it with --hardware {args.output})")
    return 0
