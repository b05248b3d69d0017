"""KTransformers' settings: decode and prefill against Fiddler at batch 1, and Expert Deferral.

Stand-ins: KTransformers -> `ktransformers`, Fiddler -> `fiddler`, Expert Deferral -> `ktransformers
--defer-experts 2`."""

from __future__ import annotations

from collections.abc import Iterator

from flowmoe.core.hardware import hardware
from flowmoe.core.memory import fitting_expert_format
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.schedulers.ktransformers import KTransformersOptions
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import successor_numbers as N
from flowmoe.study.reproduce.setting import DECODE, PREFILL, Setting, Speedup, System, paper_setup

KT_DECODE_WORK = "fixed:128:32"  # assumed: the prompt lengths of the decode runs are not stated
KT_PREFILL_LENGTH = 1024  # assumed: one of the prompt lengths the prefill comparison spans
KT_DEFER = 2  # kt-kernel/README.md: --kt-max-deferred-experts-per-token, default 2


def ktransformers(quick: bool) -> Iterator[Setting]:
    for model in N.KTRANSFORMERS_MODELS:
        if quick and model != "qwen2-57b-a14b":
            continue
        spec = preset(model)
        runs = ((DECODE, KT_DECODE_WORK, 32), (PREFILL, f"fixed:{KT_PREFILL_LENGTH}:2", 2))
        for metric, work, gen in runs[:1] if quick else runs:
            phase = metric.split()[0]
            setup = paper_setup(spec, "ktransformers-a100", work, gen, samples=4 if gen > 2 else 1)
            systems = (
                System(
                    "KTransformers (K = 0)",
                    "ktransformers",
                    setup,
                    None,
                    given=Given(batch_size=1),
                    metric=metric,
                ),
                System("Fiddler", "fiddler", setup, None, given=Given(batch_size=1), metric=metric),
            )
            low, high = N.KTRANSFORMERS_OVER_EXISTING[phase]
            yield Setting(
                "ktransformers",
                f"{model} {phase}, batch 1",
                f"{N.KTRANSFORMERS}, abstract; setup as its authors state it, sgl-project/sglang#11425",
                systems,
                (Speedup("KTransformers (K = 0)", "Fiddler", (low + high) / 2, low, high),),
                f"{work} (assumed: lengths not stated); the published range spans both baselines "
                "(llama.cpp has no stand-in) and every model; each system at its best policy that fits; "
                "no AMX kernels, NUMA-aware placement, CUDA graph or Expert Deferral (K = 0)",
            )
        if not quick:
            yield _deferral(spec, model)


def _deferral(spec: ModelSpec, model: str) -> Setting:
    """Expert Deferral against the same placement without it: every routed expert on the CPU."""
    hw = hardware("ktransformers-a100")
    setup = paper_setup(spec, hw, KT_DECODE_WORK, 32, samples=4)
    base = Policy(1, 1, weights_gpu_share=0.0, expert_format=fitting_expert_format(spec, hw))
    deferred = base.with_options(KTransformersOptions(defer_experts=KT_DEFER))
    name = f"KTransformers (K = {KT_DEFER})"
    return Setting(
        "ktransformers",
        f"{model} decode, Expert Deferral, batch 1",
        f"{N.KTRANSFORMERS}, abstract (Expert Deferral)",
        (
            System(name, "ktransformers", setup, None, deferred, metric=DECODE),
            System("KTransformers (K = 0)", "ktransformers", setup, None, base, metric=DECODE),
        ),
        (Speedup(name, "KTransformers (K = 0)", N.KTRANSFORMERS_DEFERRAL),),
        f"the published figure is a maximum ('up to 1.45x'); K = {KT_DEFER}, kt-kernel's default "
        f"(kvcache-ai/ktransformers kt-kernel/README.md, 1-4 recommended); routed experts all on the CPU; "
        f"{KT_DECODE_WORK} (assumed); deferral changes outputs (the paper: < 0.5% accuracy)",
    )
