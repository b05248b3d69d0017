"""The CUDA path, measured: every scheduler on real streams at T4- and L4-sized budgets, against
Hugging Face Accelerate's device_map offload, in one call.

On an NVIDIA GPU (H100/H200 class), with a Mixtral-8x7B-shaped model at its real layer shapes
(random bf16 weights, --layers of its 32), for each budget:
  * the pinned and pageable H2D / D2H peak, measured in this run;
  * each scheduler's tokens/s, its decode H2D link busy share and achieved bandwidth against the
    pinned peak, and its overlap efficiency (makespan / busiest lane) from its own trace;
  * Accelerate offload (transformers + accelerate, device_map with the same budget) tokens/s;
  * tokens: every scheduler on CUDA against the CPU path on a small fp32 model;
  * memory: flowmoe's own accounting of the GPU memory a run keeps alive against
    torch.cuda.max_memory_allocated (the caching allocator is capped at the budget as well).
Schedulers plan with the cost model of the machine the run is on (--hardware, an H100 by
default), not the T4 roofline their defaults assume.
The budget is the whole GPU's (16 GiB for a T4, 24 GiB for an L4) and --layers is chosen so the
model does not fit it (12 layers: 34 GiB of experts); each row says which share of the experts the
scheduler kept resident. Split a long run over calls with --budgets / --schedulers.

    python bench/gpu.py                       # on the GPU machine: writes bench/gpu.json + RESULTS rows
    python bench/gpu.py --device cpu --tiny   # a dry run of every code path on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import attrs
import torch
from gpu_support import accelerate_baseline, link_peaks, write_results
from rich.console import Console
from rich.table import Table

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.memory import gpu_memory
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy, parse_bytes
from flowmoe.core.scheduling import BatchShape, NodeFactory, SchedulerContext
from flowmoe.jobs.batching import BatchLimits
from flowmoe.jobs.engine import Engine, Request, eager_step
from flowmoe.jobs.job import first_batch
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.registry import create, load
from flowmoe.traces.chrome import chrome_trace, write_chrome
from flowmoe.traces.summary import records_by_group, summarize_records

SCHEDULERS = (
    "cgopipe",
    "klotski",
    "flexgen",
    "on-demand",
    "prefetch-all",
    "fiddler",
    "lru-cache",
    "pre-gated",
)
BUDGETS = {"t4": "16GiB", "l4": "24GiB"}
SHARES = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05, 0.0)
console = Console()


def fit_policy(model, scheduler: str, budget: int, base: Policy, batch: BatchShape, cost=None):
    """The policy with the largest resident expert share (or cache) this scheduler fits in `budget`
    with `batch` (flowmoe's memory figure, the runtime's check)."""
    spec, need = model.spec, None
    ways = base.options_for(LRUCacheOptions).cache_ways  # whole sets of the expert cache's ways
    for share in SHARES:
        slots = max(ways, int(share * spec.moe.experts * spec.layers) // ways * ways)
        policy = cache_slots(attrs.evolve(base, weights_gpu_share=share, gpu_memory=budget), scheduler, slots)
        plugin = create(scheduler, SchedulerContext(spec, policy, NodeFactory(spec), cost))
        need = gpu_memory(plugin, batch)
        if need.total <= budget:
            return policy, need
    return None, need


def cache_slots(policy: Policy, scheduler: str, slots: int) -> Policy:
    """`policy` with an expert cache of `slots` where the scheduler has one (--expert-cache-slots)."""
    own = load(scheduler).Options
    if "expert_cache_slots" not in attrs.fields_dict(own):
        return policy
    return policy.with_options(attrs.evolve(policy.options_for(own), expert_cache_slots=slots))


def requests_for(args, vocab: int) -> list[Request]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(
        args.prompt_len // 2, args.prompt_len * 3 // 2, (args.prompts,), generator=generator
    )
    return [Request(str(i), tuple(torch.randint(3, vocab, (int(n),), generator=generator).tolist()), i)
            for i, n in enumerate(lengths)]  # fmt: skip


async def generate(model, runner, requests, limits, cache_device):
    engine = Engine(model, runner, max_new_tokens=limits.max_new_tokens, cache_device=cache_device)
    results = [r async for r in engine.generate(requests, limits)]
    return sorted(results, key=lambda r: r.id), engine.stats


def run_one(model, name, policy, requests, limits, device, cost=None):
    runtime = Runtime.create(model, name, policy, device, cost)
    phases: list[tuple[bool, int, int]] = []  # (prefill, first span, end span) per step

    async def recording(m, inputs):
        first = len(runtime.trace.spans)
        out = await runtime(m, inputs)
        phases.append((any(p == 0 for i in inputs for p in i.layout.past), first, len(runtime.trace.spans)))
        return out

    try:
        results, stats = asyncio.run(generate(model, recording, requests, limits, runtime.cache_device))
    finally:
        runtime.close()
    return results, stats, runtime, phases


def decode_metrics(runtime: Runtime, phases, pinned_peak: float) -> dict:
    spans = [s for prefill, a, b in phases if not prefill for s in runtime.trace.spans[a:b]]
    if not spans:
        return {}
    records = records_by_group(chrome_trace([type(runtime.trace)(name="decode", spans=spans)]))["run"]
    summary = summarize_records("decode", records)
    lanes = {lane.lane: lane for lane in summary.lanes}
    h2d = lanes.get("gpu.h2d")
    copied = sum(s.node.bytes for s in spans if s.node.lane is Lane.GPU_H2D and s.node.op is not Op.EVICT)
    achieved = copied / (h2d.busy_us / 1e6) if h2d and h2d.busy_us else 0.0
    return {
        "h2d_busy": h2d.utilisation if h2d else 0.0,
        "h2d_gbps": achieved / 1e9,
        "h2d_of_peak": achieved / pinned_peak if pinned_peak else 0.0,
        "overlap": summary.makespan_us / summary.busiest.busy_us if summary.busiest.busy_us else 0.0,
        "busiest": summary.busiest.lane,
    }


def check_tokens(args, device: str) -> dict[str, bool]:
    """Every scheduler on `device` against the CPU eager path on a small fp32 model."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(args.model, dtype="float32", layers=2)
    requests = requests_for(argparse.Namespace(prompts=4, prompt_len=16), model.spec.vocab)
    limits = BatchLimits(micro_batches=2, micro_batch_size=2, max_new_tokens=8)
    reference, _ = asyncio.run(generate(model, eager_step, requests, limits, torch.device("cpu")))
    agree = {}
    for name in args.schedulers:
        policy = cache_slots(Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.5), name, 8)
        results, *_ = run_one(model, name, policy, requests, limits, device)
        agree[name] = [r.output_ids for r in results] == [r.output_ids for r in reference]
    return agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hardware", default="h100", help="cost model the schedulers plan with")
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run: tiny shapes, every code path")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--trace-dir", type=Path, default=Path("bench/gpu-traces"))
    parser.add_argument("--out", type=Path, default=Path("bench/gpu.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device (or --device cpu --tiny for a dry run)")
    run(args)


def run(args) -> None:
    budgets = {name: parse_bytes(BUDGETS[name]) for name in args.budgets}
    if args.tiny:  # two layers of the real shapes on the CPU, budgets that force paging
        args.layers, args.prompts, args.prompt_len, args.new_tokens = 2, 8, 12, 4
        budgets = {"t4": parse_bytes("3GiB"), "l4": parse_bytes("4GiB")}
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    meta = {"device": device_name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "model": f"{args.model} x{args.layers} layers (bf16, random)"}  # fmt: skip
    peaks = link_peaks(args.device, tiny=args.tiny)
    console.print(
        f"{device_name}: pinned H2D {peaks['h2d_pinned'] / 1e9:.1f} GB/s, "
        f"pageable {peaks['h2d_pageable'] / 1e9:.1f} GB/s, D2H {peaks['d2h_pinned'] / 1e9:.1f} GB/s"
    )
    tokens_agree = check_tokens(args, args.device)
    model = load_model(args.model, dtype="bfloat16", layers=args.layers)
    requests = requests_for(args, model.spec.vocab)
    size = -(-args.prompts // args.micro_batches)
    limits = BatchLimits(args.micro_batches, size, args.new_tokens)
    batch = first_batch(requests, limits)
    rows = []
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    base = Policy(micro_batch_size=size, micro_batches=args.micro_batches)
    cost = RooflineCost(hardware(args.hardware), model.spec)
    for budget_name, budget in budgets.items():
        for name in args.schedulers:
            row = {"budget": budget_name, "budget_bytes": budget, "scheduler": name}
            policy, need = fit_policy(model, name, budget, base, batch, cost)
            if policy is None:
                rows.append({**row, "status": f"does not fit: needs {need.describe()}"})
                continue
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _, stats, runtime, phases = run_one(model, name, policy, requests, limits, args.device, cost)
            write_chrome(args.trace_dir / f"{budget_name}-{name}.json", [runtime.trace])
            measured = {
                "status": "ok",
                "share": policy.weights_gpu_share,
                "tokens_per_s": stats.tokens_per_second,
                "prefill_s": stats.prefill_seconds,
                "decode_s": stats.decode_seconds,
                "tokens_match_cpu": tokens_agree.get(name),
                "accounted_bytes": need.total,  # flowmoe's accounting of what the run keeps alive
                "peak_allocated_bytes": torch.cuda.max_memory_allocated() if args.device == "cuda" else None,
            }
            rows.append({**row, **measured, **decode_metrics(runtime, phases, peaks["h2d_pinned"])})
        if not args.no_accelerate:
            baseline = accelerate_baseline(args, requests, budget)
            rows.append(
                {"budget": budget_name, "budget_bytes": budget, "scheduler": "accelerate-offload", **baseline}
            )
    show(rows, meta)
    args.out.write_text(json.dumps({"meta": meta, "peaks": peaks, "rows": rows}, indent=2))
    if not args.tiny:
        write_results(Path("bench/RESULTS.md"), meta, peaks, rows)


def show(rows: list[dict], meta: dict) -> None:
    table = Table(title=f"{meta['device']} — {meta['model']} — torch {meta['torch']} — {meta['date']}")
    for column in (
        "budget",
        "scheduler",
        "share",
        "tok/s",
        "H2D busy",
        "H2D GB/s (of peak)",
        "overlap",
        "GiB accounted / peak",
        "tokens = CPU",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        if r.get("status") != "ok":
            table.add_row(r["budget"], r["scheduler"], "", "", "", r.get("status", ""), "", "", "")
            continue
        link = f"{r.get('h2d_gbps', 0):.1f} ({r.get('h2d_of_peak', 0):.0%})"
        busy, overlap, agree = (
            f"{r.get('h2d_busy', 0):.0%}",
            f"{r.get('overlap', 0):.2f}",
            r.get("tokens_match_cpu"),
        )
        share, speed = f"{r.get('share', '')}", f"{r['tokens_per_s']:.1f}"
        table.add_row(r["budget"], r["scheduler"], share, speed, busy, link, overlap, memory(r), str(agree))
    console.print(table)


def memory(row: dict) -> str:
    """Accounted GiB / the caching allocator's peak GiB (the peak only where CUDA ran)."""
    accounted, peak = row.get("accounted_bytes"), row.get("peak_allocated_bytes")
    if accounted is None:
        return ""
    return f"{accounted / 2**30:.2f} / " + (f"{peak / 2**30:.2f}" if peak is not None else "-")


if __name__ == "__main__":
    main()
