"""The `flowmoe` command line. The only module that sets up uvloop, rich output and structlog."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import uvloop
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from flowmoe.builtin import ensure_builtin
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.presets import PRESETS
from flowmoe.engine import eager_step
from flowmoe.job import JobReport, JobSpec, run_job
from flowmoe.job import Progress as JobProgress
from flowmoe.loading import load_model
from flowmoe.sampling import SamplingParams
from flowmoe.tokenizer import TextCodec

console = Console(stderr=True)
SCHEDULERS = ("eager",)


def _configure_logging(json_logs: bool, verbose: bool) -> None:
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="generate completions for a JSONL prompt file")
    run.add_argument("--model", help="checkpoint folder or preset (default: the built-in tiny model)")
    run.add_argument("--prompts", required=True, type=Path, help="JSONL: {id, prompt} or {id, input_ids}")
    run.add_argument("--output", required=True, type=Path, help="JSONL results, appended and resumable")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--scheduler", default="eager", help="scheduler plugin (see `flowmoe schedulers`)")
    run.add_argument("--trace", type=Path, help="write a Chrome trace (Perfetto) of the run")
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    run.add_argument("--layers", type=int, help="cut a preset to its first LAYERS layers")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int, default=0)
    run.set_defaults(handler=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.scheduler not in SCHEDULERS:
        raise FlowmoeError(f"unknown scheduler {args.scheduler!r}; available: {', '.join(SCHEDULERS)}")
    if args.max_new_tokens < 1:
        raise FlowmoeError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling = SamplingParams(0.0 if args.greedy else args.temperature, args.top_p, args.top_k, args.seed)
    source = args.model or str(ensure_builtin())
    model = _load_with_progress(source, args.dtype, args.layers)
    codec = TextCodec.from_folder(source) if Path(source).is_dir() else None
    job = JobSpec(args.prompts, args.output, args.max_new_tokens, sampling, args.batch_size)
    with _progress() as bar:
        task = bar.add_task("generating", total=None)
        hooks = JobProgress(
            started=lambda total: bar.update(task, total=total),
            finished=lambda _r: bar.advance(task),
        )
        report = uvloop.run(run_job(job, model, codec, eager_step, hooks))
    for error in report.bad_lines:
        console.print(f"[yellow]skipped[/] {error}")
    console.print(_summary(report, source, args.scheduler))
    return 0


def _load_with_progress(source: str, dtype: str | None, layers: int | None):
    with _progress() as bar:
        task = bar.add_task(f"loading {source}", total=None)
        update: Callable[[int, int], None] = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        return load_model(source, dtype=dtype, layers=layers, progress=update)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    )  # fmt: skip


def _summary(report: JobReport, model: str, scheduler: str) -> Table:
    stats = report.stats
    table = Table(title=f"flowmoe run — {Path(model).name} — {scheduler}")
    for column in (
        "requests",
        "skipped (done)",
        "prompt tokens",
        "generated",
        "prefill s",
        "decode s",
        "tokens/s",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        str(report.requests), str(report.skipped), str(stats.prompt_tokens), str(stats.generated_tokens),
        f"{stats.prefill_seconds:.3f}", f"{stats.decode_seconds:.3f}", f"{stats.tokens_per_second:.1f}",
    )  # fmt: skip
    return table


def _add_presets(sub: argparse._SubParsersAction) -> None:
    presets = sub.add_parser("presets", help="list the paper-model presets (random weights, real shapes)")
    presets.set_defaults(handler=_cmd_presets)


def _cmd_presets(_args: argparse.Namespace) -> int:
    from flowmoe.core.presets import preset

    table = Table(title="presets")
    for column in ("name", "family", "layers", "hidden", "experts", "top-k", "params (B)"):
        table.add_column(column)
    for name in PRESETS:
        s = preset(name)
        params = s.total_bytes / s.dtype_bytes / 1e9
        table.add_row(name, s.family, str(s.layers), str(s.hidden), str(s.moe.experts), str(s.moe.top_k),
                      f"{params:.1f}")  # fmt: skip
    Console().print(table)
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="flowmoe", description=__doc__)
    top.add_argument("--log-json", action="store_true", help="structured logs as JSON lines")
    top.add_argument("-v", "--verbose", action="store_true")
    sub = top.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_presets(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _configure_logging(args.log_json, args.verbose)
    try:
        return args.handler(args)
    except FlowmoeError as exc:
        print(f"flowmoe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowmoe: interrupted; results written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
