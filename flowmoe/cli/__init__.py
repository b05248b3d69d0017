"""The `flowmoe` command line: the front-end layer, and the only one that sets up uvloop, rich output
and structlog. Each subcommand lives in a module of its own with a `register(subparsers)`; they
are imported by `main` after it has installed the signal handlers (importing torch takes a while)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from flowmoe import __version__
from flowmoe.cli.signals import Interrupted, SignalGate
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.threads import omp_waits


class HelpFormatter(argparse.HelpFormatter):
    """`--help` shows each flag's default: "(default: X)" after its help, unless the help already
    says it or there is no value to show (None: not given; False: a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _shows_default(action) or "default" in text:
            return action.help
        return f"{text} (default: %(default)s)".strip()

    def _split_lines(self, text: str, width: int) -> list[str]:
        """Wrapped at spaces only: a name such as moe-lightning-s6 is never cut at its hyphens."""
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    unset = default is None or default is False or default is argparse.SUPPRESS or default == []
    return bool(action.option_strings) and not unset


class Parser(argparse.ArgumentParser):
    """Usage errors as the other errors: the (sub)command's usage, then one `flowmoe: error:` line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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


# Each command and the module that registers it, in `--help`'s order: a command line that names
# one imports that module only (the others import what they run: `presets` starts in a blink).
COMMANDS = {
    "run": "run", "presets": "info", "schedulers": "info", "trace": "trace", "plan": "plan",
    "simulate": "simulate", "compare": "simulate", "calibrate": "calibrate", "reproduce": "reproduce",
}  # fmt: skip


def parser(argv: Sequence[str] | None = None) -> Parser:
    """The command line's parser; given `argv`, only the modules of the command it names (with
    --version and no command, none)."""
    import importlib

    top = Parser(prog="flowmoe", description="MoE inference with offloaded experts")
    top.add_argument("--version", action="version", version=f"flowmoe {__version__}")
    _global_flags(top, default=False)
    sub = top.add_subparsers(dest="command", required=True)
    named = _command_named(argv or [])
    modules = [COMMANDS[named]] if named else list(dict.fromkeys(COMMANDS.values()))
    if argv is not None and named is None and "--version" in argv:
        modules = []  # argparse prints the version and exits before it looks for a command
    for module in modules:
        importlib.import_module(f"flowmoe.cli.{module}").register(sub)
    _name_each_parser(top)
    return top


def _global_flags(parser: argparse.ArgumentParser, default: object) -> None:
    """--log-json and --verbose: on `flowmoe` itself (default False) and on every subcommand after
    its name too (default SUPPRESS, so that a flag given before the subcommand holds)."""
    parser.add_argument(
        "--log-json", action="store_true", default=default, help="structured logs as JSON lines"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default,
        help="debug logs too (first: the command's settings)",
    )  # fmt: skip


def _command_named(argv: Sequence[str]) -> str | None:
    """The command `argv` names (its first word that is not a flag), if it is one of COMMANDS."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words and words[0] in COMMANDS else None


def _name_each_parser(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser as the default `parser`, so that `main` reports an unknown flag
    with the usage of the subcommand it follows; the global flags on each subcommand too."""
    for action in parser._actions:
        if action.help is None and _shows_default(action):  # a flag without help still shows its default
            action.help = "default: %(default)s"
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(parser=child)
                if not any(a.dest == "log_json" for a in child._actions):
                    _global_flags(child, default=argparse.SUPPRESS)
                _name_each_parser(child)


def main(argv: Sequence[str] | None = None) -> int:
    omp_waits()  # before anything imports torch
    gate = SignalGate()
    with gate.installed():
        try:
            top = parser(sys.argv[1:] if argv is None else argv)
            args, unknown = top.parse_known_args(argv)
            if unknown:
                getattr(args, "parser", top).error(f"unrecognized arguments: {' '.join(unknown)}")
            configure_logging(args.log_json, args.verbose)
            if isinstance(getattr(args, "model", None), str):  # org/name: the local Hugging Face cache's copy
                from flowmoe.core.hf_cache import resolve_model

                args.model = resolve_model(args.model)
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
