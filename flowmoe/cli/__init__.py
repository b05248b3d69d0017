"""The `flowmoe` command line: the front-end layer, and the only one that sets up uvloop, rich output
and structlog. Each subcommand lives in a module of its own with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import structlog

from flowmoe.cli import calibrate, info, plan, run, simulate, trace
from flowmoe.cli.ui import console
from flowmoe.core.errors import FlowmoeError

COMMANDS = (run, info, trace, plan, simulate, calibrate)


def configure_logging(json_logs: bool, verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    renderer = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=ConsoleFile()),
    )


class ConsoleFile:
    """stderr through the rich console, so log lines print above a live progress bar."""

    def write(self, text: str) -> None:
        console.out(text, end="", highlight=False)

    def flush(self) -> None:
        console.file.flush()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="flowmoe", description="MoE inference with offloaded experts")
    top.add_argument("--log-json", action="store_true", help="structured logs as JSON lines")
    top.add_argument("-v", "--verbose", action="store_true")
    sub = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_json, args.verbose)
    try:
        return args.handler(args)
    except FlowmoeError as exc:
        print(f"flowmoe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowmoe: interrupted; results written so far are kept", file=sys.stderr)
        return 130
