"""The CUDA path, measured: every scheduler on real streams at T4- and L4-sized budgets, against
Hugging Face Accelerate's device_map offload, in one call.

On an NVIDIA GPU (H100/H200 class), with a Mixtral-8x7B-shaped model at its real layer shapes
(random bf16 weights tiled from one random block at copy speed, --layers of its 32), for each budget:
  * the pinned and pageable H2D / D2H peak, measured in this run;
  * each of the 13 schedulers' tokens/s (on-demand, flowmoe's own baseline, and accelerate among
    them), its decode H2D link busy share and achieved bandwidth against the pinned peak, and its
    overlap efficiency (makespan / busiest lane) from its own trace;
  * the simulator's prediction for the same model, policy, batch and --hardware, and measured /
    predicted;
  * Accelerate offload (transformers + accelerate, an auto device map under the same budget) tokens/s;
  * tokens: every scheduler on the device against the CPU eager path on a small fp32 model;
  * memory: flowmoe's own accounting of the GPU memory a run keeps alive against
    torch.cuda.max_memory_allocated (the caching allocator is capped at the budget as well).
Each scheduler runs isolated: its runtime in a `with` block (everything it holds released when it
ends), any exception a row with its error while the others go on, each row appended to --out (JSON
Lines, synced) as soon as it finishes; the table is printed at the end.
Schedulers plan with the cost model of the machine the run is on (--hardware, an H100 by
default), not the T4 roofline their defaults assume.
The budget is the whole GPU's (16 GiB for a T4, 24 GiB for an L4) and --layers is chosen so the
model does not fit it (12 layers: 34 GiB of experts); each row says which share of the experts the
scheduler kept resident. Split a long run over calls with --budgets / --schedulers.

    python bench/gpu.py                       # on the GPU machine: writes bench/gpu.jsonl + RESULTS rows
    python bench/gpu.py --device cpu --tiny   # a dry run of every code path on the CPU (toy widths,
                                              # budgets where every scheduler fits and pages)
    python bench/gpu.py --device cpu --tiny --fail-scheduler klotski   # isolation: one row fails
    python bench/gpu.py --trace-kernels       # traces gain the kernels that ran, rows the device-busy
                                              # time of each GPU lane (docs/traces.md)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
from gpu_support import (
    RowLog,
    accelerate_baseline,
    bench_spec,
    fast_model,
    link_peaks,
    predict,
    read_rows,
    write_results,
)
from gpu_threads import thread_table
from rich.console import Console
from rich.table import Table

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.memory import MemoryNeed, gpu_memory
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import QUANTIZED_ON_LOAD, ExpertFormat, Policy, parse_bytes
from flowmoe.core.scheduling import BatchShape, NodeFactory, SchedulerContext
from flowmoe.core.thread_cpu import ThreadCpu
from flowmoe.devices.cuda import run_ahead_setting
from flowmoe.jobs.batching import BatchLimits
from flowmoe.jobs.engine import Engine, Request, StepInput, StepStats, eager_step
from flowmoe.jobs.job import first_batch
from flowmoe.model.loading import Packing
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.registry import create, load
from flowmoe.study.sim_report import trace_device_stats
from flowmoe.traces.chrome import chrome_trace, write_chrome
from flowmoe.traces.profiler import kernels_into
from flowmoe.traces.summary import records_by_group, summarize_records

# every registered scheduler but eager (everything resident: it cannot run under these budgets) and
# zero-inference (accelerate's plan with its copies pinned: run for real, flowmoe pins every copy and runs
# no hooks, so it is the accelerate row again); on-demand is flowmoe's own baseline, accelerate flowmoe's
# plan of Accelerate's hooks (beside the real Accelerate offload row)
SCHEDULERS = (
    "cgopipe",
    "klotski",
    "flexgen",
    "moe-gen",
    "fiddler",
    "hybrimoe",
    "ktransformers",
    "fate",
    "lru-cache",
    "pre-gated",
    "prefetch-all",
    "on-demand",
    "accelerate",
)
BUDGETS = {"t4": "16GiB", "l4": "24GiB"}
SHARES = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05, 0.0)
console = Console(width=None if sys.stdout.isatty() else 200)
Phases = list[tuple[bool, int, int]]  # (prefill, first span, end span) per step


class InjectedFailure(RuntimeError):
    """--fail-scheduler: raised in the middle of that scheduler's run (its first decode step)."""


def fit_policy(
    model: MoEModel, scheduler: str, budget: int, base: Policy, batch: BatchShape, cost: Any = None
) -> tuple[Policy | None, MemoryNeed]:
    """The policy with the largest resident expert share (or cache) this scheduler fits in `budget`
    with `batch` (flowmoe's memory figure, the runtime's check)."""
    need = None
    for share in SHARES:
        policy, need = policy_at(model, scheduler, share, base, batch, cost, budget)
        if need.total <= budget:
            return policy, need
    assert need is not None
    return None, need


def policy_at(
    model: MoEModel,
    scheduler: str,
    share: float,
    base: Policy,
    batch: BatchShape,
    cost: Any,
    budget: int | None,
) -> tuple[Policy, MemoryNeed]:
    """`base` keeping `share` of the experts resident (an expert cache of as many slots, in whole
    sets of its ways, where the scheduler has one) and the GPU memory it needs with `batch`."""
    spec = model.spec
    ways = base.options_for(LRUCacheOptions).cache_ways
    slots = max(ways, int(share * spec.moe.experts * spec.layers) // ways * ways)
    policy = cache_slots(attrs.evolve(base, weights_gpu_share=share, gpu_memory=budget), scheduler, slots)
    plugin = create(
        scheduler, SchedulerContext(spec, policy, NodeFactory(spec, expert_format=policy.expert_format), cost)
    )
    return policy, gpu_memory(plugin, batch)


def cache_slots(policy: Policy, scheduler: str, slots: int) -> Policy:
    """`policy` with an expert cache of `slots` where the scheduler has one (--expert-cache-slots)."""
    own = load(scheduler).Options
    if "expert_cache_slots" not in attrs.fields_dict(own):
        return policy
    return policy.with_options(attrs.evolve(policy.options_for(own), expert_cache_slots=slots))


def requests_for(prompts: int, prompt_len: int, vocab: int) -> list[Request]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(prompt_len // 2, prompt_len * 3 // 2, (prompts,), generator=generator)
    return [Request(str(i), tuple(torch.randint(3, vocab, (int(n),), generator=generator).tolist()), i)
            for i, n in enumerate(lengths)]  # fmt: skip


async def generate(
    model: MoEModel, runner: Any, requests: list[Request], limits: BatchLimits, cache_device: Any
) -> tuple[list[Any], StepStats]:
    engine = Engine(model, runner, max_new_tokens=limits.max_new_tokens, cache_device=cache_device)
    results = [r async for r in engine.generate(requests, limits)]
    return sorted(results, key=lambda r: r.id), engine.stats


def run_in(
    runtime: Runtime,
    model: MoEModel,
    requests: list[Request],
    limits: BatchLimits,
    fail: bool = False,
    threads: ThreadCpu | None = None,
) -> tuple[list[Any], StepStats, Phases]:
    """Generate with `runtime` (the caller's `with` block closes it), recording each step's spans and,
    into `threads`, each thread's CPU time over the decode steps; `fail`: raise InjectedFailure at the
    first decode step, after the prefill ran."""
    phases: Phases = []

    async def recording(m: MoEModel, inputs: list[StepInput]) -> list[torch.Tensor]:
        prefill = any(p == 0 for i in inputs for p in i.layout.past)
        if fail and not prefill:
            raise InjectedFailure(f"injected failure (--fail-scheduler) at step {runtime.steps}, mid-run")
        first = len(runtime.trace.spans)
        measured = threads is not None and not prefill
        if measured:
            threads.start()
        out = await runtime(m, inputs)
        if measured:
            threads.stop()
        phases.append((prefill, first, len(runtime.trace.spans)))
        return out

    results, stats = asyncio.run(generate(model, recording, requests, limits, runtime.cache_device))
    return results, stats, phases


def device_metrics(runtime: Runtime) -> dict[str, Any]:
    """With --trace-kernels, each GPU lane's device-busy time (its kernels' union) against its span-busy
    time, its launch gap's share, and the launch-bound nodes (traces/device_stats.py)."""
    if not runtime.trace.kernels:
        return {}
    device = trace_device_stats(runtime.trace)
    lanes = {
        lane.lane: {"span_busy_s": lane.span_busy_seconds, "device_busy_s": lane.device_busy_seconds,
                    "launch_gap_share": lane.gap_share}
        for lane in device.lanes
    }  # fmt: skip
    return {"device_lanes": lanes, "launch_bound_nodes": device.bound_nodes, "gpu_nodes": device.gpu_nodes}


def decode_metrics(runtime: Runtime, phases: Phases, pinned_peak: float) -> dict[str, Any]:
    spans = [s for prefill, a, b in phases if not prefill for s in runtime.trace.spans[a:b]]
    if not spans:
        return {}
    records = records_by_group(chrome_trace([type(runtime.trace)(name="decode", spans=spans)]))["run"]
    summary = summarize_records("decode", records)
    lanes = {lane.lane: lane for lane in summary.lanes}
    h2d = lanes.get("gpu.h2d")
    copied = sum(s.node.bytes for s in spans if s.node.lane is Lane.GPU_H2D and s.node.op is not Op.EVICT)
    achieved = copied / (h2d.busy_us / 1e6) if h2d and h2d.busy_us else 0.0
    decode_steps = sum(1 for prefill, _, _ in phases if not prefill)
    return {
        "h2d_busy": h2d.utilisation if h2d else 0.0,
        "h2d_gbps": achieved / 1e9,
        "h2d_of_peak": achieved / pinned_peak if pinned_peak else 0.0,
        "overlap": summary.makespan_us / summary.busiest.busy_us if summary.busiest.busy_us else 0.0,
        "busiest": summary.busiest.lane,
        "nodes_per_decode_step": len(spans) / decode_steps,
        # the host's side of the GPU lanes: their threads' seconds in launches (traces: launch_us)
        "launch_s_per_decode_step": {
            lane.lane: lane.launch_seconds / decode_steps
            for lane in summary.lanes
            if lane.launch_seconds is not None
        },
    }


def release(device: str) -> None:
    """What a finished (or failed) row left behind goes back before the next one starts."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def isolated(device: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`work()`'s row, or a row with its error: one failure never stops the others."""
    started = time.perf_counter()
    try:
        row = work()
    except Exception as exc:  # any failure of one scheduler is its row, the bench goes on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        row = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
               "at": f"{Path(where.filename).name}:{where.lineno}"}  # fmt: skip
        del exc
    release(device)
    return {**row, "wall_s": time.perf_counter() - started}


def check_tokens(args: argparse.Namespace, log: RowLog) -> dict[str, Any]:
    """Every scheduler on the device against the CPU eager path on a small fp32 model (its real
    widths, or the toy ones with --tiny): True, False or the error. With --expert-format, the
    experts quantized alike and the reference the eager scheduler on the device: there the packed
    experts are dequantized as every scheduler dequantizes them, while the CPU's packed kernels
    compute with int8 activations (model/packed_experts.py), other arithmetic by design."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = fast_model(bench_spec(args.model, 2, "float32", args.tiny), packing(args))
    requests = requests_for(4, 16, model.spec.vocab)
    limits = BatchLimits(micro_batches=2, micro_batch_size=2, max_new_tokens=4 if args.tiny else 8)
    cost = RooflineCost(hardware(args.hardware), model.spec)
    if args.expert_format == "native":
        reference, _ = asyncio.run(generate(model, eager_step, requests, limits, torch.device("cpu")))
    else:
        eager = Policy(expert_format=args.expert_format)
        with Runtime.create(model, "eager", eager, args.device, cost) as runtime:
            reference, _, _ = run_in(runtime, model, requests, limits)
    agree: dict[str, Any] = {}
    for name in args.schedulers:
        run = partial(
            same_tokens, model, name, args.device, requests, limits, reference, cost, args.expert_format
        )
        row = isolated(args.device, run)
        agree[name] = row["match"] if row["status"] == "ok" else row["error"]
        log.add("tokens", {"scheduler": name, **row})
    return agree


def same_tokens(
    model: MoEModel,
    name: str,
    device: str,
    requests: list[Request],
    limits: BatchLimits,
    reference: list[Any],
    cost: RooflineCost,
    expert_format: ExpertFormat,
) -> dict[str, Any]:
    """Scheduler `name`'s tokens on `device` against `reference` (check_tokens says whose)."""
    base = Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.5, expert_format=expert_format)
    policy = cache_slots(base, name, 8)
    with Runtime.create(model, name, policy, device, cost) as runtime:
        results, _, _ = run_in(runtime, model, requests, limits)
    return {"status": "ok", "match": [r.output_ids for r in results] == [r.output_ids for r in reference]}


def packing(args: argparse.Namespace) -> Packing:
    """How fast_model keeps the routed experts: --expert-format, quantized on --device."""
    return Packing(args.expert_format, device=torch.device(args.device))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hardware", default="h100", help="cost model the schedulers plan with and the "
                        "simulator predicts with")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: tiny shapes, every code path")
    parser.add_argument("--fail-scheduler", metavar="NAME", help="make this scheduler fail mid-run "
                        "(its first decode step): the isolation check")  # fmt: skip
    parser.add_argument("--expert-format", default="native", choices=("native", *QUANTIZED_ON_LOAD),
                        help="the routed experts quantized on load (on --device) and kept packed: they "
                        "cross the link packed and are dequantized on the GPU (issue 26)")  # fmt: skip
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--trace-dir", type=Path, default=Path("bench/gpu-traces"))
    parser.add_argument("--trace-kernels", action="store_true", help="each scheduler's run under "
                        "torch.profiler: its trace gains the kernels and copies that ran, its row the GPU "
                        "lanes' device-busy time (slows the runs down)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/gpu.jsonl"), help="rows, one JSON per line")
    parser.add_argument("--results-from", type=Path, metavar="JSONL", help="run nothing: write the results "
                        "section from the rows a run on the GPU machine left (its --out)")  # fmt: skip
    parser.add_argument("--results", type=Path, default=Path("bench/RESULTS.md"), help="the file whose "
                        "section 'CUDA path: the last GPU run' the rows replace")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.results_from is not None:
        meta, peaks, rows = rows_of(read_rows(args.results_from))
        show(rows, meta)
        write_results(args.results, meta, peaks, rows)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device (or --device cpu --tiny for a dry run)")
    rows = run(args)
    fine = ("ok", "skipped")  # a baseline whose package is missing is skipped, not failed
    return (
        0 if all(r["status"].startswith(fine) or r["scheduler"] == args.fail_scheduler for r in rows) else 1
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.tiny:  # Mixtral's structure at toy widths on the CPU
        args.layers, args.prompts, args.prompt_len, args.new_tokens = 4, 8, 12, 3
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    log = RowLog(args.out)
    started = time.perf_counter()
    model = fast_model(bench_spec(args.model, args.layers, "bfloat16", args.tiny), packing(args))
    experts = "" if args.expert_format == "native" else f", experts {args.expert_format}"
    meta = {"device": device_name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "model": f"{model.spec.name} x{args.layers} layers (bf16, random{experts})",
            "hardware": args.hardware, "expert_format": args.expert_format,
            "cuda_run_ahead": run_ahead_setting(), "setup_s": time.perf_counter() - started}  # fmt: skip
    log.add("meta", meta)
    console.print(f"model set up in {meta['setup_s']:.1f} s: {meta['model']}")
    peaks = link_peaks(args.device, tiny=args.tiny)
    log.add("peaks", peaks)
    console.print(
        f"{device_name}: pinned H2D {peaks['h2d_pinned'] / 1e9:.1f} GB/s, "
        f"pageable {peaks['h2d_pageable'] / 1e9:.1f} GB/s, D2H {peaks['d2h_pinned'] / 1e9:.1f} GB/s"
    )
    agree = check_tokens(args, log)
    requests = requests_for(args.prompts, args.prompt_len, model.spec.vocab)
    size = -(-args.prompts // args.micro_batches)
    limits = BatchLimits(args.micro_batches, size, args.new_tokens)
    batch = first_batch(requests, limits)
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    base = Policy(micro_batch_size=size, micro_batches=args.micro_batches, expert_format=args.expert_format)
    cost = RooflineCost(hardware(args.hardware), model.spec)
    budgets = {name: dict.fromkeys(args.schedulers, parse_bytes(BUDGETS[name])) for name in args.budgets}
    if args.tiny:
        budgets = tiny_budgets(model, args.schedulers, base, batch, cost, args.budgets)
    rows = []
    for budget_name, each in budgets.items():
        if not args.no_accelerate:  # the baseline first: a run cut by its time limit keeps it
            most = max(each.values())
            work = partial(accelerate_baseline, model.spec, requests, args.new_tokens, args.device, most)
            row = {"budget": budget_name, "budget_bytes": most, "scheduler": "accelerate-offload"}
            rows.append({**row, **isolated(args.device, work)})
            log.add("row", rows[-1])
            console.print(f"  {budget_name} accelerate-offload: {rows[-1]['status']}")
        for name, budget in each.items():
            work = partial(
                measure, args, model, name, budget_name, budget, base, batch, requests, limits, cost, peaks
            )
            row = {
                "budget": budget_name,
                "budget_bytes": budget,
                "scheduler": name,
                **isolated(args.device, work),
            }
            rows.append({**row, "tokens_match_cpu": agree.get(name)})
            log.add("row", rows[-1])
            console.print(f"  {budget_name} {name}: {row['status']} {row.get('error', '')}")
    show(rows, meta)
    if not args.tiny:
        write_results(args.results, meta, peaks, rows)
    return rows


def rows_of(records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, float], list[dict[str, Any]]]:
    """The meta, link peaks and result rows of a --out file (JSON Lines, each with its "kind")."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        kinds.setdefault(record.pop("kind"), []).append(record)
    if not kinds.get("meta") or not kinds.get("peaks"):
        raise SystemExit("the rows file holds no meta or peaks line: not a bench/gpu.py --out file")
    return kinds["meta"][0], kinds["peaks"][0], kinds.get("row", [])


def measure(
    args: argparse.Namespace,
    model: MoEModel,
    name: str,
    budget_name: str,
    budget: int,
    base: Policy,
    batch: BatchShape,
    requests: list[Request],
    limits: BatchLimits,
    cost: RooflineCost,
    peaks: dict[str, float],
) -> dict[str, Any]:
    """One scheduler at one budget: its run in a `with` block, its trace, the simulator's prediction."""
    policy, need = fit_policy(model, name, budget, base, batch, cost)
    if policy is None:
        return {"status": f"does not fit: needs {need.describe()}"}
    threads = ThreadCpu()
    with Runtime.create(model, name, policy, args.device, cost) as runtime:
        with kernels_into(runtime.trace, runtime.devices.cuda, args.trace_kernels):
            _, stats, phases = run_in(
                runtime, model, requests, limits, fail=name == args.fail_scheduler, threads=threads
            )
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    write_chrome(args.trace_dir / f"{budget_name}-{name}.json", [runtime.trace])
    row = {
        "status": "ok",
        "share": policy.weights_gpu_share,
        "tokens_per_s": stats.tokens_per_second,
        "prefill_s": stats.prefill_seconds,
        "decode_s": stats.decode_seconds,
        "accounted_bytes": need.total,  # flowmoe's accounting of what the run keeps alive
        "peak_allocated_bytes": peak,
        **decode_metrics(runtime, phases, peaks["h2d_pinned"]),
        **device_metrics(runtime),
        "thread_cpu": threads.per_step(),  # per decode step, by thread group (flowmoe/core/thread_cpu.py)
    }
    try:
        predicted = predict(model.spec, args.hardware, name, policy, batch)
    except Exception as exc:  # a prediction that cannot be made is noted, the measurement kept
        predicted = {"predicted_error": f"{type(exc).__name__}: {exc}"}
    if predicted.get("predicted_tokens_per_s"):
        predicted["measured_over_predicted"] = row["tokens_per_s"] / predicted["predicted_tokens_per_s"]
    return {**row, **predicted}


def tiny_budgets(
    model: MoEModel, schedulers: list[str], base: Policy, batch: BatchShape, cost: Any, names: list[str]
) -> dict[str, dict[str, int]]:
    """Dry-run budgets, per scheduler, where it fits and does not hold the whole model: 40% (t4) and
    70% (l4) of the way from its smallest need (every expert paged) to its whole-model need."""
    budgets: dict[str, dict[str, int]] = {name: {} for name in names}
    for scheduler in schedulers:
        least = policy_at(model, scheduler, 0.0, base, batch, cost, None)[1].total
        whole = policy_at(model, scheduler, 1.0, base, batch, cost, None)[1].total
        for name, way in zip(names, (0.4, 0.7), strict=False):
            budgets[name][scheduler] = least + int(way * (whole - least))
    return budgets


def show(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    table = Table(title=f"{meta['device']} — {meta['model']} — torch {meta['torch']} — {meta['date']}")
    columns = ("budget", "scheduler", "share", "tok/s", f"predicted ({meta['hardware']})", "/ predicted",
               "H2D busy", "H2D GB/s (of peak)", "overlap", "GiB used / peak", "tokens = CPU")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        if r.get("status") != "ok":
            why = r.get("error") or r.get("status", "")
            table.add_row(
                r["budget"],
                r["scheduler"],
                "",
                "",
                "",
                "",
                "",
                why[:80],
                "",
                "",
                str(r.get("tokens_match_cpu", "")),
            )
            continue
        link = f"{r.get('h2d_gbps', 0):.1f} ({r.get('h2d_of_peak', 0):.0%})"
        predicted = r.get("predicted_tokens_per_s")
        ratio = r.get("measured_over_predicted")
        table.add_row(
            r["budget"],
            r["scheduler"],
            f"{r.get('share', '')}",
            f"{r['tokens_per_s']:.1f}",
            f"{predicted:.1f}" if predicted else r.get("predicted_error", "-")[:30],
            f"{ratio:.2f}" if ratio else "-",
            f"{r.get('h2d_busy', 0):.0%}" if "h2d_busy" in r else "",
            link if "h2d_gbps" in r else "",
            f"{r.get('overlap', 0):.2f}" if "overlap" in r else "",
            memory(r),
            str(r.get("tokens_match_cpu", "")),
        )
    console.print(table)
    console.print(thread_table(rows, f"{meta['device']}, torch {meta['torch']}"))


def memory(row: dict[str, Any]) -> str:
    """Accounted GiB / the caching allocator's peak GiB (the peak only where CUDA ran)."""
    accounted, peak = row.get("accounted_bytes"), row.get("peak_allocated_bytes")
    if accounted is None:
        return ""
    return f"{accounted / 2**30:.2f} / " + (f"{peak / 2**30:.2f}" if peak is not None else "-")


if __name__ == "__main__":
    sys.exit(main())
