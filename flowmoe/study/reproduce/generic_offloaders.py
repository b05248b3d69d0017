"""Generic offloaders at batch 1 (issue 28): the framework baselines users compare against, with the
host costs of their hooks (`core.host_costs`), beside the same runs priced as ideal pipelines.

Each published figure is a hook-based offloader's decode rate at batch 1. The system stands in as
`accelerate` with one module per expert (transformers 4.x, what those runs used: only the routed
experts move, each tensor a synchronous copy before its forward, freed after) and with every offloaded
layer's dense part moving too (`offload_dense`: ZeRO-3 partitions and gathers every parameter above
its persistence threshold, attention and shared experts included); "(ideal)" is the same
plan without the hooks' host costs (`Setup.host_costs` False), and "(on-demand)" flowmoe's
`on-demand` at its ideal pricing, the stand-in before issue 28: the two show what the fixed costs
and the lost overlap each add. Every figure comes from `successor_numbers`, with its table.

Not yet here: a 128-expert row. The one published generic-offloader figure found at 128 experts is the
MoE-Infinity README's (TorchMoE/MoE-Infinity: DeepSpeed and Accelerate per-token latency on one A5000 for
Switch-large-128 and NLLB-MoE-54B), both encoder-decoder models that flowmoe's decoder-only presets do
not express; and Mixtral-offloading's Table 2 (its naive-offloading row runs 2-3-bit HQQ experts, which
flowmoe's expert formats do not express).
"""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.presets import preset
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import successor_numbers as N
from flowmoe.study.reproduce.setting import DECODE, Setting, System, paper_setup

# DeepSpeed ZeRO-Inference offloads every parameter (weights share 0); batch 1, attention on the GPU
# beside the KV cache, as MoE-Gen's §A.1 runs it.
AT_BATCH_1 = Given(batch_size=1, micro_batches=1, attention_on="gpu", weights_gpu_share=0.0, kv_gpu_share=1.0)
# one module per expert (transformers 4.x); every parameter gathered per step, the dense parts too (ZeRO-3)
HOOKS = evolve(AT_BATCH_1, options={"fused_experts": 0, "offload_dense": 1})
NOTE = (
    "DeepSpeed ZeRO-Inference fetches a module's parameters in its pre-forward hook and releases them "
    "after, as Accelerate's offload hooks do, the dense parts' too; it stands in as `accelerate` (one "
    "module per expert, `offload_dense` 1) at "
    "Accelerate's measured per-tensor host cost, a lower bound for ZeRO-3's fetch path (its own per-"
    "parameter cost is not measured here), and with pageable copies where ZeRO pins its parameters"
)


def generic_offloaders(quick: bool) -> Iterator[Setting]:
    for model, experts in (("mixtral-8x7b", 8), ("deepseek-v2-lite", 64)):
        if quick and model != "deepseek-v2-lite":
            continue
        setup = paper_setup(preset(model), "moe-gen-c1", "fixed:512:32", 32)
        published = N.MOE_GEN_SMALL[(model, 1)]["DeepSpeed"]
        ideal = evolve(setup, host_costs=False)
        yield Setting(
            "generic-offloaders",
            f"{model} ({experts} experts/layer) DeepSpeed decode at batch 1, prompt 512, gen 32 @ C1",
            f"{N.MOE_GEN}, Table 9 (§A.1)",
            (
                System("DeepSpeed", "accelerate", setup, published, given=HOOKS, metric=DECODE),
                System("DeepSpeed (ideal)", "accelerate", ideal, None, given=HOOKS, metric=DECODE),
                System("DeepSpeed (on-demand)", "on-demand", ideal, None, given=AT_BATCH_1, metric=DECODE),
            ),
            note=NOTE,
        )
