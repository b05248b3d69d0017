"""MoE-Gen's settings: decode and prefill on C2 (Tables 6 and 7), small batches on C1 (Table 9).

Stand-ins: MoE-Gen(G) -> `moe-gen` (attention on the GPU, each micro-batch's KV slice copied in),
MoE-Gen(H) -> `moe-gen --attention-on cpu`, both at MoE-Gen's planner's batch sizes (`moe_gen_policy`),
DeepSpeed-Inference -> `prefetch-all` (one micro-batch), FlexGen* -> `flexgen`, MoE-Lightning* ->
`cgopipe`. Table 7's prefill rows read the same runs as Table 6's decode rows at decode 256
(`run.run_system` keeps the last runs). Decoding throughput = the tokens of the decode steps / their
time; prefill throughput = prompt tokens / prefill time (Table 7).
"""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.policy import Place, Policy
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.schedulers.moe_gen import moe_gen_policy
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import successor_numbers as N
from flowmoe.study.reproduce.setting import DECODE, PREFILL, Setting, System, paper_setup, ratios_from
from flowmoe.study.simulate import Setup, Simulation

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
            setup = paper_setup(spec, "moe-gen-c2", f"fixed:512:{gen}", gen)
            systems = _moe_gen_systems(setup, {name: figures[i] for name, figures in rows.items()}, DECODE)
            yield Setting(
                "moe-gen",
                f"{model} decode, prompt 512, gen {gen} @ C2",
                f"{N.MOE_GEN}, Table 6",
                systems,
                ratios_from(systems, MOE_GEN_PAIRS),
                MOE_GEN_NOTE,
            )
        if not quick:
            setup = paper_setup(spec, "moe-gen-c2", "fixed:512:256", 256)
            systems = _moe_gen_systems(setup, N.MOE_GEN_PREFILL[model], PREFILL)
            yield Setting(
                "moe-gen",
                f"{model} prefill, prompt 512 @ C2",
                f"{N.MOE_GEN}, Table 7",
                systems,
                ratios_from(systems, MOE_GEN_PAIRS),
                f"{MOE_GEN_NOTE}; MoE-Gen with attention on the GPU (Table 7: G and H prefill alike); each "
                "policy the best for the whole run (decode 256), not for the prefill alone",
            )
    for (model, batch), paper in N.MOE_GEN_SMALL.items():
        if quick and (model, batch) != ("deepseek-v2-lite", 1):
            continue
        setup = paper_setup(preset(model), "moe-gen-c1", "fixed:512:32", 32)
        systems = _moe_gen_systems(setup, paper, DECODE, batch)
        yield Setting(
            "moe-gen",
            f"{model} decode at batch {batch}, prompt 512, gen 32 @ C1",
            f"{N.MOE_GEN}, Table 9 (§A.1)",
            systems,
            ratios_from(systems, MOE_GEN_PAIRS),
            f"batch {batch} as Table 9; {MOE_GEN_NOTE}",
        )
