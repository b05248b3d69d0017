"""`flowmoe plan`: the HRM policy search for a model, hardware and workload (MoE-Lightning's planner)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from flowmoe.cli.args import ATTENTION_FORMAT_HELP, EXPERT_FORMAT_HELP, OUTPUT_FILE, POSITIVE_INT
from flowmoe.cli.ui import out
from flowmoe.cli.ui import table as ui_table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.expert_formats import attention_projections
from flowmoe.core.figure import PLOT, check_suffix
from flowmoe.core.hardware import HardwareSpec, hardware
from flowmoe.core.hrm import balance_point
from flowmoe.core.memory import fitting_expert_format, gib
from flowmoe.core.policy import ATTENTION_FORMATS, EXPERT_FORMATS, Place
from flowmoe.core.policy_search import CPU_USABLE, GPU_USABLE, Candidate, PlanResult, search
from flowmoe.core.presets import PRESETS, preset
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import WORKLOADS, Workload, workload


def register(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="search the policy (N, μ, placements, resident shares) with the HRM")
    add_setup_flags(plan)
    plan.add_argument("--attention-on", choices=("gpu", "cpu"), help="fix where attention runs")
    plan.add_argument("--ffn-on", choices=("gpu", "cpu"), help="fix where the MoE FFN runs")
    plan.add_argument(
        "--max-batch", type=POSITIVE_INT, default=8192, help="largest batch size N to consider (%(type)s)"
    )
    plan.add_argument("--expert-format", choices=EXPERT_FORMATS, help=EXPERT_FORMAT_HELP)
    plan.add_argument("--attention-format", choices=ATTENTION_FORMATS, help=ATTENTION_FORMAT_HELP)
    plan.add_argument("--plot", type=OUTPUT_FILE, help="write a roofline figure (.png, .svg or .pdf)")
    plan.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_force_flag(plan)
    plan.set_defaults(handler=_plan)


def add_setup_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-m", "--model", required=True, help=f"preset ({', '.join(PRESETS)}) or checkpoint folder"
    )
    parser.add_argument(
        "--layers", type=POSITIVE_INT, help="cut the model to its first LAYERS layers (%(type)s)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    from flowmoe.core.hardware_presets import PRESETS as HARDWARE  # torch-free, ~15 ms

    parser.add_argument(
        "--hardware", default="t4",
        help=f"hardware preset (any case: {', '.join(HARDWARE)}) or a profile JSON from `flowmoe calibrate`",
    )  # fmt: skip
    parser.add_argument("--workload", default="mtbench", help=f"{', '.join(WORKLOADS)} or fixed:PROMPT:GEN")
    parser.add_argument(
        "--gen-len", type=POSITIVE_INT, help="generation length (%(type)s; default: the workload's)"
    )


def spec_from(args: argparse.Namespace) -> ModelSpec:
    path = Path(args.model)
    if not path.is_dir():
        return preset(args.model, layers=args.layers, dtype=args.dtype)
    spec = ModelSpec.from_hf(path)
    if args.layers is not None:
        spec = spec.with_layers(args.layers)
    return spec.with_dtype(args.dtype) if args.dtype else spec


def workload_from(args: argparse.Namespace) -> Workload:
    work = workload(args.workload)
    return work.with_gen_len(args.gen_len) if args.gen_len is not None else work


def _plan(args: argparse.Namespace) -> int:
    guard = write_guard(args, [("--plot", args.plot, PLOT)])
    if args.plot:
        check_suffix(args.plot, "--plot")
    spec, hw, work = spec_from(args), hardware(args.hardware), workload_from(args)
    attention: tuple[Place, ...] = (args.attention_on,) if args.attention_on else ("gpu", "cpu")
    ffn: tuple[Place, ...] = (args.ffn_on,) if args.ffn_on else ("gpu", "cpu")
    form = args.expert_format or fitting_expert_format(spec, hw)
    attention_note = _attention_note(spec, args.attention_format)
    result = search(spec, hw, work, attention, ffn, max_batch=args.max_batch, expert_format=form)
    context = result.best.prompt + max(1, result.best.gen // 2)
    balance = balance_point(spec, hw, result.best.policy, context)
    if args.plot:
        from flowmoe.study.roofline_plot import plot_roofline

        plot_roofline(spec, hw, result.best.policy, context, args.plot, guard)
    if args.json:
        print(json.dumps(plan_json(spec, hw, work, result, balance)))
        return 0
    out.print(policy_table(spec, hw, work, result.best))
    out.print(times_table(spec, result.best))
    out.print(placements_table(result))
    out.print(
        f"turning points: P1 = {result.p1:.1f} flop/B (CPU peak / link), P2 = {result.p2:.1f} flop/B "
        f"(FFN kernel at μ={result.best.policy.micro_batch_size} / link); the chosen FFN sits at "
        f"{result.ffn_link_intensity:.1f} flop/B on the link; balance point N = {balance} "
        f"(smallest batch no longer bound by the CPU->GPU link); {result.searched} policies searched"
    )
    if args.plot:
        out.print(f"roofline: {args.plot}")
    if attention_note:
        out.print(attention_note)
    return 0


def _attention_note(spec: ModelSpec, attention_format: str | None) -> str | None:
    """The HRM keeps every layer's dense part on the GPU (MoE-Lightning's policy), where attention is
    held dequantized: an attention format moves no byte less over its link (grouped-query attention
    only: `attention_projections` refuses MLA)."""
    if attention_format in (None, "native"):
        return None
    attention_projections(spec)
    return (
        f"--attention-format {attention_format}: this plan keeps every layer's attention on the GPU "
        "(dequantized), so the format changes none of its figures; `flowmoe simulate --scheduler klotski` "
        "offloads attention and prices its packed bytes"
    )


def policy_table(spec: ModelSpec, hw: HardwareSpec, work: Workload, best: Candidate) -> Table:
    p = best.policy
    title = f"plan: {spec.name} on {hw.name}, {work.name} (prompt {best.prompt}, gen {best.gen})"
    table = ui_table(title, ("policy", "value"))
    rows = {
        "batch size N": p.batch_size, "micro-batch size μ": p.micro_batch_size,
        "micro-batches": p.micro_batches, "attention on": p.attention_on, "MoE FFN on": p.ffn_on,
        "weights on GPU": f"{p.weights_gpu_share:.0%}", "KV cache on GPU": f"{p.kv_gpu_share:.0%}",
        "tokens/s": f"{best.throughput:.1f}", "bound by": best.bound,
    }  # fmt: skip
    for name, value in rows.items():
        table.add_row(name, str(value))
    table.caption = (
        f"GPU memory {gib(best.gpu_bytes)} of {gib(GPU_USABLE * hw.gpu_memory)} usable; "
        f"CPU memory {gib(best.cpu_bytes)} of {gib(CPU_USABLE * hw.cpu_memory)} usable"
    )
    return table


def times_table(spec: ModelSpec, best: Candidate) -> Table:
    table = ui_table(
        "predicted time per layer (ms): each resource's busy time; the layer takes the largest",
        ("phase", "GPU", "CPU", "CPU->GPU", "GPU->CPU", "layer", "bound by"),
        justify="right",
    )
    for name, times in (("prefill", best.prefill), ("decode step", best.decode)):
        b = times.busy
        cells = [b.gpu, b.cpu, b.h2d, b.d2h, times.seconds]
        table.add_row(name, *(f"{1e3 * v / spec.layers:.2f}" for v in cells), times.bound)
    return table


def placements_table(result: PlanResult) -> Table:
    columns = ("attention", "MoE FFN", "N", "μ", "weights on GPU", "tokens/s", "bound by")
    table = ui_table("best policy per placement", columns, justify="right")
    for c in result.per_placement:
        p = c.policy
        table.add_row(p.attention_on, p.ffn_on, str(p.batch_size), str(p.micro_batch_size),
                      f"{p.weights_gpu_share:.0%}", f"{c.throughput:.1f}", c.bound)  # fmt: skip
    return table


def plan_json(
    spec: ModelSpec, hw: HardwareSpec, work: Workload, result: PlanResult, balance: int
) -> dict[str, Any]:
    def candidate(c: Candidate) -> dict[str, Any]:
        p = c.policy
        return {
            "batch_size": p.batch_size, "micro_batch_size": p.micro_batch_size,
            "micro_batches": p.micro_batches, "attention_on": p.attention_on, "ffn_on": p.ffn_on,
            "weights_gpu_share": p.weights_gpu_share, "kv_gpu_share": p.kv_gpu_share,
            "throughput_tokens_per_second": c.throughput, "bound": c.bound,
            "prefill_seconds": c.prefill.seconds, "decode_step_seconds": c.decode.seconds,
            "decode_layer_seconds": c.decode.seconds / spec.layers,
            "gpu_bytes": c.gpu_bytes, "cpu_bytes": c.cpu_bytes,
        }  # fmt: skip

    return {
        "model": spec.name, "hardware": hw.name, "workload": work.name, "prompt": result.best.prompt,
        "gen": result.best.gen, "best": candidate(result.best),
        "per_placement": [candidate(c) for c in result.per_placement], "p1": result.p1, "p2": result.p2,
        "ffn_link_intensity": result.ffn_link_intensity, "balance_point": balance,
        "searched": result.searched,
    }  # fmt: skip
