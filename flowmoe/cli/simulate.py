"""`flowmoe simulate` and `flowmoe compare`: schedulers on the SimWorker at paper scale, on any machine.

Both run a batch of the workload through the real schedulers under the
roofline cost of a hardware spec, with routing from a recorded trace or a
synthetic one; `compare --trace` writes one Chrome trace with a process group
per scheduler (stacked in Perfetto). Every policy flag given is honoured; the
fields not given come from each scheduler's own best policy (a search per
scheduler, `flowmoe.study.best_policy`), and each result row shows the policy
it ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import evolve
from rich.table import Table

from flowmoe.cli.args import (
    ATTENTION_FORMAT_HELP,
    BYTES,
    EXPERT_FORMAT_HELP,
    FRACTION,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
)
from flowmoe.cli.option_flags import add_option_flags, check_taken, given_options, options_of
from flowmoe.cli.plan import add_setup_flags, spec_from, workload_from
from flowmoe.cli.ui import console, out, steps, table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.errors import ConfigError
from flowmoe.core.expert_formats import attention_projections
from flowmoe.core.hardware import hardware
from flowmoe.core.options import check_options
from flowmoe.core.policy import ATTENTION_FORMATS, EXPERT_FORMATS, Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.schedulers.registry import available
from flowmoe.study.auto_choice import choice, job_workload, rank
from flowmoe.study.best_policy import Given, best_policy, describe_policy
from flowmoe.study.sim_report import SimulationResult
from flowmoe.study.simulate import Setup
from flowmoe.traces.chrome import CHROME_TRACE, write_chrome

if TYPE_CHECKING:  # these run tensors (torch): imported where a run needs them
    from flowmoe.jobs.job import JobSpec
    from flowmoe.model.moe_model import MoEModel
    from flowmoe.model.tokenizer import TextCodec


def register(sub: argparse._SubParsersAction) -> None:
    simulate = sub.add_parser("simulate", help="simulate schedulers on a workload batch at paper scale")
    _flags(simulate)
    simulate.add_argument("-s", "--scheduler", default="all", help="a scheduler name, or all")
    simulate.add_argument("--trace", type=Path, help="write the simulated steps as a Chrome trace")
    simulate.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_force_flag(simulate)
    simulate.set_defaults(handler=_simulate)
    compare = sub.add_parser("compare", help="several schedulers on one setup: one stacked trace and a table")
    _flags(compare)
    compare.add_argument("--schedulers", help="comma-separated names (default: every registered one)")
    compare.add_argument("--trace", type=Path, help="write one Chrome trace, a process group per scheduler")
    compare.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_force_flag(compare)
    compare.set_defaults(handler=_compare)


def _flags(parser: argparse.ArgumentParser) -> None:
    add_setup_flags(parser)
    policy = parser.add_argument_group(
        "policy: each flag given is honoured; the fields not given come from each scheduler's best plan"
    )
    policy.add_argument("-b", "--batch-size", type=POSITIVE_INT, help="N sequences in the batch")
    policy.add_argument("--micro-batches", type=POSITIVE_INT, help="micro-batches per batch")
    policy.add_argument("--attention-on", choices=("gpu", "cpu"))
    policy.add_argument("--ffn-on", choices=("gpu", "cpu"))
    policy.add_argument("--weights-gpu-share", type=FRACTION, help="share of experts kept on the GPU")
    policy.add_argument("--kv-gpu-share", type=FRACTION, help="share of the KV cache kept on the GPU")
    policy.add_argument("--gpu-memory", type=BYTES, help="GPU memory budget (default: the hardware's)")
    policy.add_argument("--expert-format", choices=EXPERT_FORMATS, help=EXPERT_FORMAT_HELP)
    policy.add_argument("--attention-format", choices=ATTENTION_FORMATS, help=ATTENTION_FORMAT_HELP)
    policy.add_argument("--cpu-threads", type=POSITIVE_INT, help="CPU threads per op (%(type)s)")
    add_option_flags(parser)  # each scheduler's own, from its options class (as `flowmoe run` takes them)
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--routing", type=Path, help="routing trace recorded by `flowmoe run --record-routing`"
    )
    routing.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of expert popularity")
    routing.add_argument("--correlation", type=float, default=0.3, help="layer-to-layer routing correlation")
    routing.add_argument(
        "--pregate-accuracy", type=FRACTION, default=0.9,
        help="chance a pre-gate prediction keeps each true expert (pre-gated schedulers' prefetch; %(type)s)",
    )  # fmt: skip
    routing.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing (an integer)")
    parser.add_argument(
        "--decode-samples", type=NON_NEGATIVE_INT, default=4, help="decode steps simulated (0: all)"
    )
    realtime_help = (
        "run the simulated steps again on the real clock: the real host stack, each "
        "device action replaced by waiting its modelled time (--trace writes that run)"
    )
    parser.add_argument("--realtime", action="store_true", help=realtime_help)


def given_from(args: argparse.Namespace) -> Given:
    """The policy fields given on the command line (None: the search chooses)."""
    return Given(
        args.batch_size, args.micro_batches, args.attention_on, args.ffn_on, args.weights_gpu_share,
        args.kv_gpu_share, args.gpu_memory, args.cpu_threads, expert_format=args.expert_format,
        attention_format=args.attention_format, options=given_options(args),
    )  # fmt: skip


def setup_from(args: argparse.Namespace) -> Setup:
    """The setup without its policy (each scheduler gets its own, `best_policy`)."""
    spec, hw, work = spec_from(args), hardware(args.hardware), workload_from(args)
    if args.attention_format not in (None, "native"):
        attention_projections(spec)  # grouped-query attention only: MLA refused in one line
    recorded = _recorded(args.routing, spec) if args.routing else None
    model = RoutingModel(args.skew, args.correlation, args.pregate_accuracy, args.seed)
    policy = Policy(gpu_memory=args.gpu_memory)
    return Setup(spec, hw, work, policy, model, recorded, args.decode_samples, args.seed)


def _recorded(path: Path, spec: ModelSpec) -> RoutingTrace:
    if not path.exists():
        raise ConfigError(f"{path}: routing trace not found")
    return RoutingTrace.load(path, spec)


def _names(requested: str | None) -> list[str]:
    names = list(available())
    if requested in (None, "all"):
        return names
    chosen = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown or not chosen:
        raise ConfigError(
            f"unknown scheduler {unknown[0] if unknown else requested!r}; available: {', '.join(names)}"
        )
    return chosen


def _simulate(args: argparse.Namespace) -> int:
    return _report(args, _names(args.scheduler))


def _compare(args: argparse.Namespace) -> int:
    return _report(args, _names(args.schedulers))


def _report(args: argparse.Namespace, names: list[str]) -> int:
    guard = write_guard(args, [("--trace", args.trace, CHROME_TRACE)])
    setup, given = setup_from(args), given_from(args)
    check_taken(given.options, names)
    for name in names:  # each one's options against the model: a page size against its experts, …
        check_options(options_of(name, given.options), setup.spec)
    results = []
    with steps("searching each scheduler's best policy", len(names)) as done:
        for name in names:
            results.append(best_policy(setup, name, given))
            done(name)
    if args.realtime:
        import uvloop

        from flowmoe.study.realtime import with_realtime

        with console.status("running the simulated steps on the real clock"):
            results = [with_realtime(setup, r, uvloop.run) for r in results]
    traces = [r.realtime.trace if r.realtime else r.trace for r in results if r.trace is not None]
    if args.trace and traces:
        write_chrome(args.trace, traces, guard)
    if args.json:
        print(json.dumps(results_json(setup, results, given)))
        return 0
    out.print(results_table(setup, results))
    out.print(choices_table(setup, results, given))
    for line in policy_lines(results):
        out.print(line, soft_wrap=True, highlight=False)
    for r in results:
        if r.error is not None:
            out.print(f"[yellow]{r.scheduler}[/] cannot run: {r.error}", soft_wrap=True)
    if len(results) == 1 and results[0].error is None:
        out.print(lanes_table(results[0]))
    if args.realtime:
        out.print(realtime_table(results))
    if args.trace and traces:
        out.print(f"trace: {args.trace} ({len(traces)} process groups; open in https://ui.perfetto.dev)")
    return 0


def realtime_table(results: list[SimulationResult]) -> Table:
    columns = (
        "scheduler",
        "steps",
        "simulated\ns",
        "real-clock\ns",
        "ratio",
        "host CPU\ns/step",
        "top thread",
    )
    shown = table("the simulated steps on the real clock (real host stack, modelled device time)", columns,
                  "right", prose=("top thread",))  # fmt: skip
    for r in results:
        if (rt := r.realtime) is not None:
            thread = max(rt.host_seconds, key=rt.host_seconds.__getitem__)
            shown.add_row(
                r.scheduler,
                str(rt.steps),
                f"{rt.makespan_seconds:.3f}",
                f"{rt.realtime_makespan_seconds:.3f}",
                f"{rt.ratio:.3f}",
                f"{rt.host_seconds_per_step:.3f}",
                f"{thread} {rt.host_seconds[thread]:.2f} s",
            )
    return shown


def auto_scheduler(args: argparse.Namespace, model: MoEModel, codec: TextCodec | None,
                   job: JobSpec) -> tuple[str, Policy, JobSpec]:  # fmt: skip
    """`run --scheduler auto`: rank every scheduler on this job's workload (prompt lengths, max new
    tokens) and hardware (--hardware, or a quick CPU-only calibration of this machine), print the
    ranking, and give the best one with its policy and the job at that policy's batch."""
    from flowmoe.jobs.job import read_work

    requests = read_work(job, model, codec, job.limits(model)).requests
    new_tokens = max((r.new_tokens(job.max_new_tokens) for r in requests), default=job.max_new_tokens)
    work = job_workload([len(r.input_ids) for r in requests], new_tokens)
    if args.hardware:
        hw = hardware(args.hardware)
    else:
        from flowmoe.study.calibrate import calibrate

        with console.status("describing this machine (quick CPU-only calibration)"):
            hw, _measured = calibrate(quick=True, dtype=model.spec.dtype, device="cpu")
    memory = args.gpu_memory  # already bytes (the flag's type parses it)
    given = Given(gpu_memory=memory, expert_format=args.expert_format, attention_format=args.attention_format)
    with console.status(f"simulating every scheduler on this job ({len(requests)} requests) on {hw.name}"):
        results = rank(model.spec, hw, work, list(available()), max(1, len(requests)), given)
    setup = Setup(model.spec, hw, work, Policy())
    console.print(results_table(setup, results))
    console.print(choices_table(setup, results, given))
    for line in policy_lines(results):
        console.print(line, soft_wrap=True, highlight=False)
    best = choice(results)
    console.print(f"auto: running {best.scheduler} ({describe_policy(best.policy, best.scheduler)})")
    policy = evolve(best.policy, gpu_memory=given.gpu_memory)
    return (
        best.scheduler,
        policy,
        evolve(job, batch_size=policy.batch_size, micro_batches=policy.micro_batches),
    )


def results_table(setup: Setup, results: list[SimulationResult]) -> Table:
    work = setup.workload
    title = f"simulated: {setup.spec.name} on {setup.hardware.name}, {work.name} gen {work.gen_len}"
    columns = (
        "scheduler",
        "tokens/s",
        "vs best",
        "prefill s",
        "decode s",
        "busiest lane",
        "share",
        "bubbles s",
    )
    shown = table(title, [c.replace(" ", "\n") for c in columns], "right")
    best = max((r.throughput for r in results), default=0.0)
    for r in sorted(results, key=lambda r: -r.throughput):
        if r.error is not None:
            shown.add_row(r.scheduler, "-", "-", "-", "-", "[yellow]cannot run[/]", "-", "-")
            continue
        busiest = max(r.lanes, key=lambda lane: lane.busy_seconds)
        versus = f"{r.throughput / best:.2f}" if best else "-"
        shown.add_row(r.scheduler, f"{r.throughput:.1f}", versus, f"{r.prefill_seconds:.1f}",
                      f"{r.decode_seconds:.1f}", busiest.lane, f"{r.utilisation(busiest):.0%}",
                      f"{busiest.bubble_seconds:.2f}")  # fmt: skip
    shown.caption = (
        "share: the busiest lane's busy time / (prefill + decode); tokens/s = generated tokens / that "
        "time; bubbles = time the busiest lane sat idle with its next node queued, waiting on "
        "dependencies; each scheduler ran its best policy that fits, with every given flag (below; "
        "--json: every figure)"
    )
    return shown


# The policy fields a search chooses where no flag gives them, and the flag that pins each
# (docs/simulator.md); the GPU experts also follow --expert-cache-slots where a scheduler has a cache.
PINNED_BY = {
    "batch_size": "--batch-size", "micro_batches": "--micro-batches", "attention_on": "--attention-on",
    "ffn_on": "--ffn-on", "weights_gpu_share": "--weights-gpu-share", "kv_gpu_share": "--kv-gpu-share",
}  # fmt: skip


def searched(given: Given) -> list[str]:
    """The fields of `PINNED_BY` the search chose: those no flag gave (the GPU experts count as given
    with --expert-cache-slots)."""
    slots = given.options.get("expert_cache_slots") is not None
    return [f for f in PINNED_BY if getattr(given, f) is None and not (f == "weights_gpu_share" and slots)]


def choices_table(setup: Setup, results: list[SimulationResult], given: Given) -> Table:
    """Per scheduler, its per-token decode latency (mean, p50, p90) and what its plan chose that a
    user may not expect: N and its micro-batches, where attention and the experts run, how many
    experts the GPU holds per MoE layer (an expert cache's slots, else those resident) and the KV
    cache's share on the GPU; a value the search chose (no flag gave it) is marked *."""
    title = "per-token decode latency (s) and what each plan chose (*: the search chose it)"
    columns = ("scheduler", "s/token mean", "p50", "p90", "N", "μxn", "attn", "ffn", "GPU experts /layer",
               "KV on GPU")  # fmt: skip
    shown = table(title, [c.replace(" ", "\n") for c in columns], "right")
    for r in sorted(results, key=lambda r: -r.throughput):
        if r.error is None:
            shown.add_row(r.scheduler, *_latency(r), *_chosen(r, given))
    shown.caption = (
        "s/token: a decode step's time (each sequence gets a token per step); attn, ffn: where decode "
        "ran attention and the routed experts (x% cpu: that share of their tokens on the CPU); GPU "
        f"experts of the {setup.spec.moe.experts} per MoE layer: an expert cache's slots, else those "
        "resident. Pin each with its flag: --batch-size, --micro-batches, --attention-on, --ffn-on, "
        "--weights-gpu-share or --expert-cache-slots, --kv-gpu-share (docs/simulator.md)"
    )
    return shown


def _where(cpu: float | None, planned: str) -> str:
    """Where decode ran it: gpu, cpu, or the CPU's share of its rows (the policy's placement where
    none ran)."""
    if cpu is None:
        return planned
    return "gpu" if cpu == 0 else "cpu" if cpu == 1 else f"{cpu:.0%} cpu"


def _latency(r: SimulationResult) -> tuple[str, str, str]:
    t = r.token_latency
    return ("-", "-", "-") if t is None else (f"{t.mean:.3f}", f"{t.p50:.3f}", f"{t.p90:.3f}")


def _chosen(r: SimulationResult, given: Given) -> tuple[str, ...]:
    """The plan's N, μ x micro-batches, placements, GPU experts per layer and KV share, each marked *
    where the search chose it."""
    p, chosen = r.policy, searched(given)

    def mark(field: str, text: str) -> str:
        return f"{text}*" if field in chosen else text

    held = "-" if r.experts_per_layer is None else f"{r.experts_per_layer:.1f}"
    micro = f"{p.micro_batch_size}x{p.micro_batches}"
    return (mark("batch_size", str(p.batch_size)), mark("micro_batches", micro),
            mark("attention_on", _where(r.cpu_attention, p.attention_on)),
            mark("ffn_on", _where(r.cpu_experts, p.ffn_on)), mark("weights_gpu_share", held),
            mark("kv_gpu_share", f"{p.kv_gpu_share:.0%}"))  # fmt: skip


def policy_lines(results: list[SimulationResult]) -> list[str]:
    """The policy each scheduler ran, a line each (too long for a table cell at 80 columns)."""
    return [f"{r.scheduler}: {describe_policy(r.policy, r.scheduler)}" for r in results]


def lanes_table(result: SimulationResult) -> Table:
    shown = table(f"{result.scheduler}: lanes over the whole batch", ("lane", "busy s", "utilisation",
                  "bubbles s"), "right")  # fmt: skip
    for lane in result.lanes:
        shown.add_row(lane.lane, f"{lane.busy_seconds:.2f}", f"{result.utilisation(lane):.1%}",
                      f"{lane.bubble_seconds:.2f}")  # fmt: skip
    return shown


def results_json(setup: Setup, results: list[SimulationResult], given: Given | None = None) -> dict[str, Any]:
    """Every figure of every result; with `given`, each says which policy fields the search chose
    (`chosen_by_search`, the flags that pin them in `pinned_by`)."""
    chosen = {} if given is None else {"chosen_by_search": searched(given), "pinned_by": PINNED_BY}
    return {
        "model": setup.spec.name, "hardware": setup.hardware.name, "workload": setup.workload.name,
        "gen_len": setup.workload.gen_len, "decode_samples": setup.decode_samples, **chosen,
        "results": [{**r.to_json(), "policy_text": describe_policy(r.policy, r.scheduler)} for r in results],
    }  # fmt: skip
