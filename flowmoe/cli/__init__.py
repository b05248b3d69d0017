"""The `flowmoe` command line: the front-end layer, and the only one that sets up uvloop, rich output
and structlog. Each subcommand lives in a module of its own with a `register(subparsers)`; they
are imported by `main` after it has installed the signal handlers (importing torch takes a while)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from flowmoe import __version__
from flowmoe.cli.signals import Interrupted, SignalGate
from flowmoe.core.errors import FlowmoeError


class Parser(argparse.ArgumentParser):
    """Usage errors as the other errors: the (sub)command's usage, then one `flowmoe: error:` line."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"flowmoe: error: {message}\n")


def configure_logging(json_logs: bool, verbose: bool) -> None:
    import structlog

    from flowmoe.cli.ui import console

    class ConsoleFile:
        """stderr through the rich console, so log lines print above a live progress bar."""

        def write(self, text: str) -> None:
            console.out(text, end="", highlight=False)

        def flush(self) -> None:
            console.file.flush()

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
        logger_factory=structlog.PrintLoggerFactory(file=ConsoleFile()),  # type: ignore[arg-type]  # structlog calls only write and flush
    )


def parser() -> Parser:
    from flowmoe.cli import calibrate, info, plan, reproduce, run, simulate, trace

    top = Parser(prog="flowmoe", description="MoE inference with offloaded experts")
    top.add_argument("--version", action="version", version=f"flowmoe {__version__}")
    top.add_argument("--log-json", action="store_true", help="structured logs as JSON lines")
    top.add_argument(
        "-v", "--verbose", action="store_true", help="debug logs too (first: the command's settings)"
    )
    sub = top.add_subparsers(dest="command", required=True)
    for command in (run, info, trace, plan, simulate, calibrate, reproduce):
        command.register(sub)
    _name_each_parser(top)
    return top


def _name_each_parser(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser as the default `parser`, so that `main` reports an unknown flag
    with the usage of the subcommand it follows."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(parser=child)
                _name_each_parser(child)


def main(argv: Sequence[str] | None = None) -> int:
    gate = SignalGate()
    with gate.installed():
        try:
            top = parser()
            args, unknown = top.parse_known_args(argv)
            if unknown:
                getattr(args, "parser", top).error(f"unrecognized arguments: {' '.join(unknown)}")
            configure_logging(args.log_json, args.verbose)
            _log_command(args)
            with gate.armed():
                return args.handler(args)
        except SystemExit as exc:  # usage errors (2), --help and --version (0)
            return exc.code if isinstance(exc.code, int) else 2
        except Interrupted as exc:
            return _interrupted(exc.exit_code)
        except KeyboardInterrupt:
            return _interrupted(130)
        except FlowmoeError as exc:
            print(f"flowmoe: error: {exc}", file=sys.stderr)
            return 2


def _log_command(args: argparse.Namespace) -> None:
    """The command's settings, defaults included, as one debug line."""
    import structlog

    settings = {k: str(v) for k, v in vars(args).items() if k not in ("handler", "parser")}
    structlog.get_logger("flowmoe.cli").debug("command", version=__version__, **settings)


def _interrupted(code: int) -> int:
    print("flowmoe: interrupted; results written so far are kept", file=sys.stderr)
    return code
