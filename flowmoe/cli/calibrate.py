"""`flowmoe calibrate`: measure this machine and save a hardware profile for --hardware PATH."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowmoe.cli.args import OUTPUT_FILE, POSITIVE_INT
from flowmoe.cli.plan import spec_from
from flowmoe.cli.ui import out, status
from flowmoe.cli.ui import table as ui_table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.hardware import PROFILE, save_profile


def register(sub: argparse._SubParsersAction) -> None:
    calibrate = sub.add_parser(
        "calibrate", help="measure this machine's flop/s and bandwidths into a profile"
    )
    calibrate.add_argument(
        "-o", "--output", type=OUTPUT_FILE, default=Path("hardware.json"), help="profile JSON to write"
    )
    calibrate.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    calibrate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    calibrate.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto",
        help="auto or cuda: this machine's GPU (refused without one); cpu: a profile of CPU-only runs "
        "(gpu.* lanes on the CPU), for simulating runs on this machine",
    )  # fmt: skip
    calibrate.add_argument(
        "-m", "--model", help="measure the matmul and attention shapes of this preset or checkpoint"
    )
    calibrate.add_argument(
        "--threads", type=POSITIVE_INT, help="torch threads per op, as the runs' --cpu-threads (%(type)s)"
    )
    add_force_flag(calibrate)
    calibrate.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    guard = write_guard(args, [("--output", args.output, PROFILE)])
    import torch

    from flowmoe.study.calibrate import Shapes, calibrate

    if args.device in ("auto", "cuda") and not torch.cuda.is_available():
        raise FlowmoeError(
            "calibrate: this machine has no GPU (CUDA) to measure; `--device cpu` writes a profile of "
            "CPU-only runs (gpu.* lanes on the CPU, host copies free) for simulating runs here"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    shapes = (
        Shapes.of(spec_from(argparse.Namespace(model=args.model, layers=None, dtype=None)))
        if args.model
        else None
    )
    with status("calibrating") as spinner:
        spec, measurements = calibrate(
            args.quick, args.dtype, lambda step: spinner.update(step), args.device, shapes
        )
    save_profile(spec, args.output, guard)
    table = ui_table(
        f"calibration of {spec.name}", ("measurement", "value", "unit"), "right", prose=("measurement",)
    )
    for m in measurements:
        table.add_row(m.name, f"{m.value:.3g}", m.unit)
    table.caption = spec.source
    out.print(table)
    out.print(f"profile: {args.output} (use it with --hardware {args.output})")
    return 0
