"""Fate's settings, from its abstract: decode and prefill against Load on Demand (`on-demand`) at
batch 1."""

from __future__ import annotations

from collections.abc import Iterator

from flowmoe.core.presets import preset
from flowmoe.study.best_policy import Given
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

FATE_WORKS = {"decode": ("fixed:128:32", 32), "prefill": ("fixed:512:2", 2)}  # assumed: lengths not at hand
FATE_NOTE = (
    "the published figure is a maximum ('up to') over Fate's models and memory budgets; batch 1; each "
    "system at its best policy that fits the 11 GB GPU; Load on Demand = `on-demand`; the EAP baseline "
    "has no stand-in (no flowmoe scheduler prefetches from expert activation paths); not modelled: "
    "Fate's popularity-aware INT2/INT4 hybrid quantization of the copied experts (here every expert "
    "crosses the link at the checkpoint's bf16, so Fate's copies are 4-8x larger than the paper's; the "
    "'FP8 experts' row, copies half as large, shows its direction); "
    "machine: the RTX 1080 Ti its introduction names, on an assumed desktop host (its host not at hand)"
)


def fate(quick: bool) -> Iterator[Setting]:
    spec = preset(N.FATE_MODEL)
    for phase, (work, gen) in FATE_WORKS.items():
        if quick and phase != "decode":
            continue
        metric = DECODE if phase == "decode" else PREFILL
        setup = paper_setup(spec, "fate-1080ti", work, gen, samples=4 if gen > 2 else 1)
        at = Given(batch_size=1)
        systems: tuple[System, ...] = (
            System("Fate", "fate", setup, None, given=at, metric=metric),
            System("Load on Demand", "on-demand", setup, None, given=at, metric=metric),
        )
        # the direction of the quantization left out: FP8, flowmoe's nearest format to INT4 (half of bf16)
        fp8 = Given(batch_size=1, expert_format=NEAREST_INT4)
        systems += (System("Fate, FP8 experts", "fate", setup, None, given=fp8, metric=metric),)
        if phase == "decode" and not quick:
            systems += (System("Fate (cache)", "fate", setup, N.FATE_HIT, given=at, metric="hit rate"),)
        yield Setting(
            "fate",
            f"{N.FATE_MODEL} {phase}, batch 1 @ GTX 1080 Ti",
            f"{N.FATE}, abstract",
            systems,
            (Speedup("Fate", "Load on Demand", N.FATE_OVER_ON_DEMAND[phase]),),
            f"{work} (assumed); {FATE_NOTE}",
        )
