"""What FP8 experts on the link buy an offloading schedule: simulated decode throughput, native vs fp8.

For Mixtral-8x7B and Qwen3-30B-A3B in bf16 (Qwen3-30B-A3B-FP8 is a released FP8 checkpoint; the
Mixtral row prices the same format on the papers' model) on MoE-Lightning's S1 machine (1 x T4,
`t4`) and an H100 host (`h100`), MTBench prompts, gen 32. Each format gets its own HRM plan
(`flowmoe plan --expert-format`, N capped at 256 to keep the simulation short), run by cgopipe.
`--expert-format fp8` prices an expert's copy at a byte per weight plus one float32 scale per
128 x 128 block (DeepSeek-V3's `weight_block_size`), and its dequantization on the GPU.

    python bench/fp8_link.py --label baseline

Prints a rich table; results go into bench/fp8_link.json under the label.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flowmoe.core.hardware import hardware
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study.best_policy import describe_policy
from flowmoe.study.simulate import Setup, Simulation

OUT = Path(__file__).with_suffix(".json")
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
MACHINES = ("t4", "h100")
SCHEDULERS = ("cgopipe",)  # the HRM plan is MoE-Lightning's policy for CGOPipe (attention may be on the CPU)
MAX_BATCH = 256
GEN = 32


def rows() -> list[dict[str, Any]]:
    out = []
    for model in MODELS:
        spec = preset(model, dtype="bfloat16")
        for machine in MACHINES:
            hw, work = hardware(machine), workload("mtbench").with_gen_len(GEN)
            for form in ("native", "fp8"):
                policy = search(spec, hw, work, max_batch=MAX_BATCH, expert_format=form).best.policy
                for name in SCHEDULERS:
                    setup = Setup(spec, hw, work, policy, RoutingModel(seed=0), decode_samples=2)
                    result = Simulation(setup).run(name)
                    h2d = next((lane for lane in result.lanes if lane.lane == "gpu.h2d"), None)
                    out.append({
                        "model": model, "hardware": machine, "format": form, "scheduler": name,
                        "policy": describe_policy(policy, name),
                        "error": result.error, "tokens_per_second": result.throughput,
                        "h2d_gib": h2d.bytes / 2**30 if h2d else 0.0,
                    })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="baseline")
    args = parser.parse_args()
    results = rows()
    table = Table(title="FP8 experts on the link (simulated decode, MTBench gen 32)")
    for column in ("model", "hardware", "scheduler", "native tok/s", "fp8 tok/s", "speedup", "h2d GiB n/fp8"):
        table.add_column(column)
    keyed = {(r["model"], r["hardware"], r["scheduler"], r["format"]): r for r in results}
    for model in MODELS:
        for machine in MACHINES:
            for name in SCHEDULERS:
                n, f = keyed[(model, machine, name, "native")], keyed[(model, machine, name, "fp8")]
                speedup = f["tokens_per_second"] / n["tokens_per_second"] if n["tokens_per_second"] else 0.0
                rates = (f"{n['tokens_per_second']:.1f}", f"{f['tokens_per_second']:.1f}", f"{speedup:.2f}x")
                table.add_row(model, machine, name, *rates, f"{n['h2d_gib']:.0f} / {f['h2d_gib']:.0f}")
    Console().print(table)
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    previous[args.label] = {"machine": platform.node(), "rows": results}
    OUT.write_text(json.dumps(previous, indent=1) + "\n")


if __name__ == "__main__":
    main()
