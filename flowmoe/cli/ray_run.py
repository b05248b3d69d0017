"""`flowmoe run --ray ADDRESS --replicas N`: one resumable job over N replicas (flowmoe/cluster),
with a progress bar per replica and one for the job, and a table per replica at the end."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import Progress, TextColumn
from rich.table import Table

from flowmoe.cli.args import POSITIVE_INT
from flowmoe.cli.simulate import auto_scheduler
from flowmoe.cli.ui import console, progress, table
from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy
from flowmoe.core.write_guard import Guard
from flowmoe.model.tokenizer import TextCodec
from flowmoe.traces.chrome import write_chrome

if TYPE_CHECKING:
    from flowmoe.cluster.ray_job import ClusterProgress, ClusterReport
    from flowmoe.jobs.sampling import SamplingParams


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("many replicas (pip install 'flowmoe[ray]')")
    group.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster (host:port, auto, or local: this machine's CPUs)",
    )
    group.add_argument(
        "--replicas",
        type=POSITIVE_INT,
        help="model replicas, one GPU each (CPU slices without GPUs) (%(type)s)",
    )
    group.add_argument(
        "--replica-cpus", type=POSITIVE_INT, default=1, help="CPUs (torch threads) per replica (%(type)s)"
    )


def run_on_ray(args: argparse.Namespace, sampling: SamplingParams, policy: Policy, guard: Guard) -> int:
    """The job over `--replicas` replicas of the Ray cluster at `--ray`; `guard` guards --trace."""
    from flowmoe.cli.run import TokenRateColumn, job_from, routing_profile  # run.py imports this module
    from flowmoe.model.builtin import ensure_builtin

    if args.record_routing:
        raise ConfigError("--record-routing is not available with --ray; record it in a single-process run")
    if args.trace_kernels:
        raise ConfigError("--trace-kernels is not available with --ray; profile a single-process run")
    try:
        from flowmoe.cluster.model_spec import model_spec
        from flowmoe.cluster.ray_job import alive_nodes, run_on_cluster, session
        from flowmoe.cluster.replica import ReplicaConfig
        from flowmoe.cluster.resources import ReplicaResources
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ConfigError("--ray needs Ray: pip install 'flowmoe[ray]'") from exc
    source = args.model or str(ensure_builtin())
    model = model_spec(source, args.dtype, args.layers)  # the driver reads no weight
    job = job_from(args, model, sampling)  # type: ignore[arg-type]  # a SpecOnly: only .spec is read
    scheduler = args.scheduler
    if scheduler == "auto":
        codec = TextCodec.from_folder(source) if Path(source).is_dir() else None
        scheduler, policy, job = auto_scheduler(args, model, codec, job)  # type: ignore[arg-type]  # a SpecOnly: only .spec is read
    with session(args.ray) as cluster:
        resources = ReplicaResources.choose(args.device, args.replica_cpus, alive_nodes())
        config = ReplicaConfig(
            source, args.dtype, args.layers, scheduler, policy, job, resources.device, resources.num_cpus,
            record=bool(args.trace),
            cost=RooflineCost(hardware(args.hardware), model.spec) if args.hardware else None,
            popularity=routing_profile(args.routing_profile, model) if args.routing_profile else None,  # type: ignore[arg-type]  # a SpecOnly: only .spec is read
        )  # fmt: skip
        replicas = args.replicas or 1
        with progress(TextColumn("{task.fields[tokens]} tokens"), TokenRateColumn()) as bar:
            # asyncio's own loop: Ray completes its futures from its own threads, and after a Ctrl-C
            # while replicas start, late completions on a closed uvloop loop crash the interpreter
            report = asyncio.run(run_on_cluster(config, replicas, resources, cluster, _bars(bar, replicas)))
    for error in report.bad_lines:
        console.print(f"[yellow]skipped[/] {escape(error)}", soft_wrap=True)
    console.print(summary_table(report, source, scheduler, cluster))
    if not args.trace:
        return 0
    try:
        write_chrome(args.trace, report.traces, guard)
    except FlowmoeError as exc:
        console.print(f"flowmoe: error: {exc}", soft_wrap=True, highlight=False, markup=False)
        return 2
    nodes = sum(len(t.spans) for t in report.traces)
    console.print(
        f"trace: {args.trace} ({nodes} nodes, a process per replica; open in https://ui.perfetto.dev)"
    )
    return 0


def _bars(bar: Progress, replicas: int) -> ClusterProgress:
    """One bar for the job and one per replica, each with its tokens and tokens/s since the replicas
    were up (loading the model is not generation)."""
    from flowmoe.cluster.ray_job import ClusterProgress

    job = bar.add_task("all replicas", total=None, start=False, tokens=0)
    each = [bar.add_task(f"replica {i}", total=None, start=False, tokens=0) for i in range(replicas)]
    tokens = [0] * (replicas + 1)

    def generated(replica: int, count: int) -> None:
        tokens[replica] += count
        tokens[-1] += count
        bar.update(each[replica], tokens=tokens[replica])
        bar.update(job, tokens=tokens[-1])

    def finished(replica: int) -> None:
        bar.advance(each[replica])
        bar.advance(job)

    def started(requests: int, _replicas: int) -> None:  # the replicas are up: the clocks start
        bar.update(job, total=requests)
        for task in (job, *each):
            bar.start_task(task)

    return ClusterProgress(
        started=started,
        finished=finished,
        generated=generated,
    )


def summary_table(report: ClusterReport, model: str, scheduler: str, cluster: str) -> Table:
    columns = ("replica", "results", "generated", "restarts", "tokens/s")
    result = table(f"flowmoe run — {Path(model).name} — {scheduler} — Ray {cluster}", columns, "right")
    seconds = report.seconds or float("inf")
    for replica in report.replicas:
        result.add_row(str(replica.index), str(replica.results), str(replica.tokens), str(replica.restarts),
                       f"{replica.tokens / seconds:.1f}")  # fmt: skip
    results, restarts = sum(r.results for r in report.replicas), sum(r.restarts for r in report.replicas)
    result.add_row("all", str(results), str(report.generated_tokens), str(restarts),
                   f"{report.tokens_per_second:.1f}")  # fmt: skip
    result.caption = (
        f"{report.requests} requests, {report.skipped} skipped (done), {report.requeued} queued again "
        f"after a replica died; {report.startup_seconds:.2f} s to start the replicas, "
        f"{report.seconds:.2f} s to generate"
    )
    return result
