"""`flowmoe reproduce moe-gen | hybrimoe | ktransformers | fate`: the successor papers' published numbers
next to the simulator's, in `reproduce`'s Setting / System structure, on the hardware presets of the
papers' machines (`moe-gen-c1/c2`, `hybrimoe-a6000`, `ktransformers-a100`, `fate-1080ti`). Every compared
number is in `successor_numbers` with its table or section.

Stand-ins: MoE-Gen(G) -> `moe-gen` (attention on the GPU, each micro-batch's KV slice copied in),
MoE-Gen(H) -> `moe-gen --attention-on cpu`, both at MoE-Gen's planner's batch sizes (`moe_gen_policy`),
DeepSpeed-Inference -> `prefetch-all` (one micro-batch), FlexGen* -> `flexgen`, MoE-Lightning* ->
`cgopipe`; kTransformers -> `ktransformers` at the cache ratio (that share of the MoE layers' experts
on the GPU), HybriMoE -> `hybrimoe` at the cache ratio; Fiddler -> `fiddler`; KTransformers' Expert
Deferral -> `ktransformers --defer-experts 2`; Fate -> `fate`, Load on Demand -> `on-demand`. Where a
paper gives no policy, each system runs the best policy that fits its scheduler (`best_policy`). MoE-Gen's
Table 7 prefill rows read the same runs as its Table 6 decode rows at decode 256 (`reproduce.run_system`
keeps the last runs).
Metrics: MoE-Gen's decoding throughput = the tokens of the decode steps / their time; prefill
throughput = prompt tokens / prefill time (Table 7); HybriMoE's time between tokens as its inverse
(decode tokens/s at batch 1), TTFT as prefill tokens/s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from attrs import evolve

from flowmoe.core.hardware import hardware
from flowmoe.core.memory import fitting_expert_format
from flowmoe.core.policy import Place, Policy
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.schedulers.moe_gen import moe_gen_policy
from flowmoe.study import successor_numbers as N
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import Setting, Speedup, System, _ratios_from, _setup
from flowmoe.study.simulate import Setup, Simulation

DECODE, PREFILL = "decode tok/s", "prefill tok/s"

# MoE-Gen ------------------------------------------------------------------------------------------

MOE_GEN_PAIRS = (
    *((fast, slow) for fast in ("MoE-Gen(H)", "MoE-Gen(G)", "MoE-Gen")
      for slow in ("DeepSpeed", "FlexGen*", "MoE-Lightning*", "MoE-Lightning(p)*")),
    ("MoE-Gen(H)", "MoE-Gen(G)"),
)  # fmt: skip
MOE_GEN_NOTE = (
    "prompts padded to 512 as §5.1 runs every system; MoE-Gen at its planner's batch sizes (the KV cache "
    "in host memory); FlexGen* and MoE-Lightning* at the HRM plan their scheduler's memory takes (at "
    "Table 9's batch: their best policy that fits), DeepSpeed at its best single micro-batch; Llama.cpp "
    "and vLLM rows have no stand-in"
)


def _moe_gen_systems(
    setup: Setup, paper: dict[str, float], metric: str, batch: int | None = None
) -> tuple[System, ...]:
    """The systems of a MoE-Gen table that flowmoe expresses, with their published figures. MoE-Gen
    runs at its own planner's sizes (`moe_gen_policy`: the batch host memory holds the KV cache of,
    or the table's batch; the attention micro-batch GPU memory holds), no expert resident ("MoE-Gen
    deliberately offloads more data to host memory", §A.1); the baselines at their best that fits."""
    at = Given(batch_size=batch)
    work = setup.workload
    lightning = next(name for name in paper if name.startswith("MoE-Lightning"))

    def planned(where: Place) -> Policy:
        return moe_gen_policy(setup.spec, setup.hardware, round(work.prompt.mean), work.gen_len, where, batch)

    # Tables 6-7: FlexGen* and MoE-Lightning* at their planner's policy; Table 9's batch: the best that fits
    flexgen, cgopipe = (
        (None, None) if batch else (_hrm_planned(setup, "flexgen"), _hrm_planned(setup, "cgopipe"))
    )
    runs: dict[str, tuple[str, Policy | None, Given]] = {
        "DeepSpeed": ("prefetch-all", None, Given(batch_size=batch, micro_batches=1)),
        "FlexGen*": ("flexgen", flexgen, at),
        lightning: ("cgopipe", cgopipe, at),
        "MoE-Gen(G)": ("moe-gen", planned("gpu"), at),
        "MoE-Gen(H)": ("moe-gen", planned("cpu"), at),
        "MoE-Gen": ("moe-gen", planned("gpu"), at),
    }
    return tuple(
        System(name, runs[name][0], setup, figure, runs[name][1], runs[name][2], metric=metric)
        for name, figure in paper.items()
    )


def _hrm_planned(setup: Setup, scheduler: str) -> Policy:
    """The policy FlexGen's and MoE-Lightning's own planners pick, as `reproduce` runs MoE-Lightning in its
    paper's settings: the HRM plan (`policy_search.search`, a cost model over MoE-Lightning's knobs) over
    the placements the scheduler has (experts on the GPU), its batch halved until the scheduler's own
    GPU and host accounting takes it."""
    spec, hw, work, cap = setup.spec, setup.hardware, setup.workload, 8192
    while True:
        policy = search(spec, hw, work, ffn=("gpu",), max_batch=cap).best.policy
        if cap == 1 or Simulation(evolve(setup, policy=policy, decode_samples=1)).refusal(scheduler) is None:
            return policy
        cap = max(1, policy.batch_size // 2)


def moe_gen(quick: bool) -> Iterator[Setting]:
    for model, rows in N.MOE_GEN_DECODE.items():
        if quick and model != "mixtral-8x7b":
            continue
        spec = preset(model)
        for i, gen in enumerate(N.MOE_GEN_DECODE_LENS):
            if quick and gen != 256:
                continue
            setup = _setup(spec, "moe-gen-c2", f"fixed:512:{gen}", gen)
            systems = _moe_gen_systems(setup, {name: figures[i] for name, figures in rows.items()}, DECODE)
            yield Setting(
                "moe-gen",
                f"{model} decode, prompt 512, gen {gen} @ C2",
                f"{N.MOE_GEN}, Table 6",
                systems,
                _ratios_from(systems, MOE_GEN_PAIRS),
                MOE_GEN_NOTE,
            )
        if not quick:
            setup = _setup(spec, "moe-gen-c2", "fixed:512:256", 256)
            systems = _moe_gen_systems(setup, N.MOE_GEN_PREFILL[model], PREFILL)
            yield Setting(
                "moe-gen",
                f"{model} prefill, prompt 512 @ C2",
                f"{N.MOE_GEN}, Table 7",
                systems,
                _ratios_from(systems, MOE_GEN_PAIRS),
                f"{MOE_GEN_NOTE}; MoE-Gen with attention on the GPU (Table 7: G and H prefill alike); each "
                "policy the best for the whole run (decode 256), not for the prefill alone",
            )
    for (model, batch), paper in N.MOE_GEN_SMALL.items():
        if quick and (model, batch) != ("deepseek-v2-lite", 1):
            continue
        setup = _setup(preset(model), "moe-gen-c1", "fixed:512:32", 32)
        systems = _moe_gen_systems(setup, paper, DECODE, batch)
        yield Setting(
            "moe-gen",
            f"{model} decode at batch {batch}, prompt 512, gen 32 @ C1",
            f"{N.MOE_GEN}, Table 9 (§A.1)",
            systems,
            _ratios_from(systems, MOE_GEN_PAIRS),
            f"batch {batch} as Table 9; {MOE_GEN_NOTE}",
        )


# HybriMoE -----------------------------------------------------------------------------------------

HYBRIMOE_WORK = "fixed:128:32"  # assumed: §VI-A's ChatGPT-prompts lengths are not stated (TBT is insensitive)
HYBRID_EXPERTS = "fp8"  # the nearest flowmoe format to the paper's 4-bit experts (§V), for both systems
HYBRIMOE_NOTE = (
    "batch 1; experts stored and copied as FP8 for both systems (the paper's are 4-bit; flowmoe has no "
    "INT4); kTransformers = `ktransformers` with that share of the MoE layers' experts on the GPU; "
    "llama.cpp and AdapMoE have no stand-in"
)


def _cached(share: float) -> Policy:
    return Policy(1, 1, weights_gpu_share=share, expert_format=HYBRID_EXPERTS)


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
    setup = _setup(qwen, "hybrimoe-a6000", HYBRIMOE_WORK, samples=4)
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
    setup = _setup(spec, "hybrimoe-a6000", HYBRIMOE_WORK, samples=4)
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
            _setup(spec, "hybrimoe-a6000", f"fixed:{length}:2", 2, 1), share, PREFILL, f" {length}"
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


# KTransformers ------------------------------------------------------------------------------------

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
            setup = _setup(spec, "ktransformers-a100", work, gen, samples=4 if gen > 2 else 1)
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
    setup = _setup(spec, hw, KT_DECODE_WORK, 32, samples=4)
    base = Policy(1, 1, weights_gpu_share=0.0, expert_format=fitting_expert_format(spec, hw))
    deferred = evolve(base, defer_experts=KT_DEFER)
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


# Fate ---------------------------------------------------------------------------------------------

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
        setup = _setup(spec, "fate-1080ti", work, gen, samples=4 if gen > 2 else 1)
        at = Given(batch_size=1)
        systems = (
            System("Fate", "fate", setup, None, given=at, metric=metric),
            System("Load on Demand", "on-demand", setup, None, given=at, metric=metric),
        )
        # the direction of the quantization left out: FP8, flowmoe's nearest format to INT4 (half of bf16)
        fp8 = Given(batch_size=1, expert_format=HYBRID_EXPERTS)
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


SUCCESSOR_BUILDERS: dict[str, Callable[[bool], Iterator[Setting]]] = {
    "moe-gen": moe_gen,
    "hybrimoe": hybrimoe,
    "ktransformers": ktransformers,
    "fate": fate,
}
