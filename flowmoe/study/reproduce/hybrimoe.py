"""HybriMoE's settings: decode and prefill against kTransformers per model and cache ratio, and its
expert hit rate.

Stand-ins: kTransformers -> `ktransformers` at the cache ratio (that share of the MoE layers' experts on
the GPU), HybriMoE -> `hybrimoe` at the cache ratio. Its time between tokens as its inverse (decode
tokens/s at batch 1), TTFT as prefill tokens/s.
"""

from __future__ import annotations

from collections.abc import Iterator

from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.study.reproduce import successor_numbers as N
from flowmoe.study.reproduce.setting import (
    DECODE,
    NEAREST_INT4,
    PREFILL,
    Setting,
    Speedup,
    System,
    paper_setup,
)
from flowmoe.study.simulate import Setup

HYBRIMOE_WORK = "fixed:128:32"  # assumed: §VI-A's ChatGPT-prompts lengths are not stated (TBT is insensitive)
HYBRIMOE_NOTE = (
    "batch 1; experts stored and copied as FP8 for both systems (the paper's are 4-bit; flowmoe has no "
    "INT4); kTransformers = `ktransformers` with that share of the MoE layers' experts on the GPU; "
    "llama.cpp and AdapMoE have no stand-in"
)


def _cached(share: float) -> Policy:
    return Policy(1, 1, weights_gpu_share=share, expert_format=NEAREST_INT4)


def _pair(
    setup: Setup,
    share: float,
    metric: str,
    suffix: str = "",
    figures: tuple[float | None, ...] = (None, None),
) -> tuple[System, ...]:
    return tuple(
        System(f"{name}{suffix}", scheduler, setup, figure, _cached(share), metric=metric)
        for (name, scheduler), figure in zip(
            (("kTransformers", "ktransformers"), ("HybriMoE", "hybrimoe")), figures, strict=True
        )
    )


def hybrimoe(quick: bool) -> Iterator[Setting]:
    qwen = preset("qwen2-57b-a14b")
    setup = paper_setup(qwen, "hybrimoe-a6000", HYBRIMOE_WORK, samples=4)
    table = N.HYBRIMOE_TABLE3_DECODE
    systems = _pair(setup, 0.25, DECODE, figures=(1 / table["kTransformers"], 1 / table["HybriMoE"]))
    yield Setting(
        "hybrimoe",
        "qwen2-57b-a14b decode, 25% cache",
        f"{N.HYBRIMOE}, Table III",
        systems,
        (Speedup("HybriMoE", "kTransformers", N.HYBRIMOE_TABLE3_SPEEDUP),),
        f"published tokens/s = 1 / the table's decode latency; {HYBRIMOE_WORK} (assumed); {HYBRIMOE_NOTE}",
    )
    for model in N.HYBRIMOE_MODELS:
        if quick and model != "deepseek-v2-lite":
            continue
        spec = preset(model)
        for share in N.HYBRIMOE_RATIOS:
            if quick and share != 0.25:
                continue
            yield from _hybrid_settings(spec, model, share, quick)


def _hybrid_settings(spec: ModelSpec, model: str, share: float, quick: bool) -> Iterator[Setting]:
    setup = paper_setup(spec, "hybrimoe-a6000", HYBRIMOE_WORK, samples=4)
    systems = _pair(setup, share, DECODE)
    hit = N.HYBRIMOE_HIT.get((model, share))
    if hit is not None:
        systems += (System("HybriMoE (MRS)", "hybrimoe", setup, hit, _cached(share), metric="hit rate"),)
    yield Setting(
        "hybrimoe",
        f"{model} decode, {share:.0%} cache",
        f"{N.HYBRIMOE}, §VI-B (decode), §VI-D (hit rate)",
        systems,
        (Speedup("HybriMoE", "kTransformers", N.HYBRIMOE_OVER_KT["decode"]),),
        f"the published speedup is the average over models and cache ratios, compared with each; "
        f"{HYBRIMOE_WORK} (assumed); {HYBRIMOE_NOTE}",
    )
    if quick:
        return
    prefill = tuple(
        system
        for length in N.HYBRIMOE_LENGTHS
        for system in _pair(
            paper_setup(spec, "hybrimoe-a6000", f"fixed:{length}:2", 2, 1), share, PREFILL, f" {length}"
        )
    )
    yield Setting(
        "hybrimoe",
        f"{model} prefill (TTFT), {share:.0%} cache",
        f"{N.HYBRIMOE}, §VI-B (prefill)",
        prefill,
        tuple(
            Speedup(f"HybriMoE {n}", f"kTransformers {n}", N.HYBRIMOE_OVER_KT["prefill"])
            for n in N.HYBRIMOE_LENGTHS
        ),
        "prompts of 32/128/512/1024 tokens (§VI-B); the published speedup is the average over lengths, "
        f"cache ratios and models, compared with each; {HYBRIMOE_NOTE}",
    )
