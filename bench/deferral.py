"""KTransformers' Expert Deferral (`--defer-experts K`): what it costs in outputs, what it buys in time.

1. Outputs: on a tiny random checkpoint of every family with top-k >= 2 (tests/hf_models.py, written
   by transformers), each prompt alone (batch 1, the paper's single-request decode: exactly K of a
   decode token's experts deferred) through the exact eager model and the eager model with Expert
   Deferral at every layer ktransformers defers (`MoEModel.forward(deferral=...)`, which the
   ktransformers runtime equals: tests/test_ktransformers_deferral.py). Decode is teacher-forced with
   the exact model's greedy tokens, so every step compares the same context: the largest absolute
   logit difference, the largest relative one (max |d| / max |logits| of the step), the share of
   steps whose top-1 token agrees; and the share of greedy tokens equal when each runs free.
   Random weights say how far the logits move, not how much accuracy a trained model loses (the
   paper: at most 0.5% on average over its benchmarks).
2. Time: `flowmoe simulate` of ktransformers at batch 1 on the paper's machine (ktransformers-a100:
   dual Xeon 8452Y + A100 40GB, hardware_presets.py) with K = 0, 1, ...: decode tokens/s and the
   speedup over K = 0 (the paper: up to 1.45x from Expert Deferral).

Prints rich tables, writes bench/deferral.json.

    python bench/deferral.py            # every family, K up to 3; DeepSeek-V2-Lite, Qwen2-57B, Mixtral
    python bench/deferral.py --quick    # three families, 8 decode steps, DeepSeek-V2-Lite only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from attrs import evolve
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/hf_models.py

from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import Deferral, MoEModel
from flowmoe.schedulers.ktransformers import KTransformersOptions, deferring_layers
from flowmoe.study.simulate import Setup, Simulation
from tests.hf_models import hf_model, save_hf

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "phimoe", "granitemoe", "ernie4_5_moe"]  # fmt: skip
QUICK_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]
SIMULATED = ["deepseek-v2-lite", "qwen2-57b-a14b", "mixtral-8x7b"]
PAPER_SPEEDUP = 1.45  # SOSP '25 abstract: "up to 1.45x additional throughput" from Expert Deferral
PROMPTS, PROMPT_LEN = 4, 12


def run_one(model: MoEModel, prompt: torch.Tensor, steps: int, deferral: Deferral, forced: list[int] | None):
    """One prompt alone: -> (per decode step logits [V], greedy tokens). `forced`: feed these tokens."""
    cache = model.new_cache(1, len(prompt) + steps + 1)
    logits, tokens = [], []
    with torch.inference_mode():
        out = model.forward(prompt, cache, TokenLayout((0,), (len(prompt),), (0,)), deferral=deferral)[0]
        for step in range(steps):
            logits.append(out)
            tokens.append(int(out.argmax()))
            fed = forced[step] if forced is not None else tokens[-1]
            layout = TokenLayout((0,), (1,), (len(prompt) + step,))
            out = model.forward(torch.tensor([fed]), cache, layout, deferral=deferral)[0]
    return logits, tokens


def deviation(family: str, folder: Path, steps: int) -> list[dict[str, Any]]:
    model = load_model(folder)
    top_k, layers = model.spec.moe.top_k, deferring_layers(model.spec)
    prompts = torch.randint(
        3, model.spec.vocab, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(0)
    )
    exact = Deferral(0, frozenset())
    reference = [run_one(model, p, steps, exact, None) for p in prompts]
    rows = []
    for k in range(1, min(top_k, 4)):
        deferral = Deferral(k, layers)
        worst_abs = worst_rel = 0.0
        agree = same = total = 0
        for prompt, (ref_logits, ref_tokens) in zip(prompts, reference, strict=True):
            logits, tokens = run_one(model, prompt, steps, deferral, ref_tokens)
            for ours, ref in zip(logits, ref_logits, strict=True):
                diff = float((ours - ref).abs().max())
                worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / float(ref.abs().max()))
            agree += sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
            _, free = run_one(model, prompt, steps, deferral, None)
            same += sum(a == b for a, b in zip(free, ref_tokens, strict=True))
            total += steps
        rows.append({"family": family, "top_k": top_k, "defer_experts": k, "layers": sorted(layers),
                     "max_abs_logit_diff": worst_abs, "max_rel_logit_diff": worst_rel,
                     "top1_agreement_forced": agree / total, "greedy_equal": same / total})  # fmt: skip
    return rows


def speedups(name: str) -> list[dict[str, Any]]:
    spec = preset(name)
    policy = Policy(micro_batch_size=1, micro_batches=1, weights_gpu_share=0.0)
    setup = Setup(spec, hardware("ktransformers-a100"), workload("mtbench").with_gen_len(64), policy,
                  RoutingModel(seed=0), decode_samples=3)  # fmt: skip
    rows, base = [], None
    for k in range(min(spec.moe.top_k, 5)):
        deferred = policy.with_options(KTransformersOptions(defer_experts=k))
        result = Simulation(evolve(setup, policy=deferred)).run("ktransformers")
        if result.error is not None:
            rows.append({"model": name, "defer_experts": k, "error": result.error})
            continue
        decode_rate = (
            result.generated - result.sequences
        ) / result.decode_seconds  # the first token: prefill
        base = base or decode_rate
        rows.append({"model": name, "top_k": spec.moe.top_k, "defer_experts": k,
                     "decode_tokens_per_s": decode_rate, "speedup": decode_rate / base})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three families, 8 steps, one simulated model")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 8 if args.quick else args.steps
    console = Console(width=120)
    load = os.getloadavg()
    outputs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in QUICK_FAMILIES if args.quick else FAMILIES:
            folder = save_hf(hf_model(family), Path(tmp) / family)
            outputs += deviation(family, folder, steps)
    times = [row for name in (SIMULATED[:1] if args.quick else SIMULATED) for row in speedups(name)]
    table = Table(
        title=f"Expert Deferral vs the exact model: tiny random checkpoints, batch 1, {steps} steps"
    )
    for column in (
        "family",
        "top-k",
        "K",
        "layers",
        "max |d logit|",
        "max rel",
        "top-1 agree",
        "greedy equal",
    ):
        table.add_column(column, justify="right")
    for r in outputs:
        table.add_row(r["family"], str(r["top_k"]), str(r["defer_experts"]), str(r["layers"]),
                      f"{r['max_abs_logit_diff']:.3g}", f"{r['max_rel_logit_diff']:.3g}",
                      f"{r['top1_agreement_forced']:.0%}", f"{r['greedy_equal']:.0%}")  # fmt: skip
    console.print(table)
    sim = Table(
        title=f"simulated ktransformers decode, batch 1, ktransformers-a100 (paper: up to {PAPER_SPEEDUP}x)"
    )
    for column in ("model", "K", "decode tok/s", "speedup"):
        sim.add_column(column, justify="right")
    for r in times:
        if "error" in r:
            sim.add_row(r["model"], str(r["defer_experts"]), r["error"], "")
        else:
            sim.add_row(
                r["model"], str(r["defer_experts"]), f"{r['decode_tokens_per_s']:.2f}", f"{r['speedup']:.2f}x"
            )
    console.print(sim)
    after = os.getloadavg()
    console.print(f"load average before {load[0]:.2f}, after {after[0]:.2f}")
    record = {"machine": platform.platform(), "load_before": load, "load_after": after, "steps": steps,
              "outputs": outputs, "simulated": times}  # fmt: skip
    if not args.quick:
        Path(__file__).with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
