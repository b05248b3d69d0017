"""Generic offloaders at batch 1 (issue 28): the framework baselines users compare against, with the
host costs of their hooks (`core.host_costs`), beside the same runs priced as ideal pipelines.

Each published figure is a hook-based offloader's decode rate at batch 1. DeepSpeed stands in as
`zero-inference` (`accelerate`'s plan, its copies pinned, ZeRO-3's measured hook costs) with one module
per expert (transformers 4.x, what those runs used: only the routed experts move, each tensor a
synchronous copy before its forward, freed after) and with every offloaded layer's dense part moving too
(`offload_dense`: ZeRO-3 partitions and gathers every parameter above its persistence threshold,
attention and shared experts included); "(ideal)" is the same
plan without the hooks' host costs (`Setup.host_costs` False), and "(on-demand)" flowmoe's
`on-demand` at its ideal pricing, the stand-in before issue 28: the two show what the fixed costs
and the lost overlap each add. Every figure comes from `successor_numbers`, with its table.

MoE-Infinity's README gives DeepSpeed and Accelerate per-token latency on one A5000 for the same two
models (`generic_offloader_numbers`); its host is not stated, so they run on `moe-gen-c1`, the A5000 of
MoE-Gen (the same group, EfficientMoE), whose DeepSpeed figures they match (2.486 s against 0.4 tok/s,
0.737 s against 1.3 tok/s). Accelerate stands in as `accelerate` with one module per expert
(transformers 4.x) and whole decoder layers offloaded (`offload_dense`: `device_map` places layers, not
experts), the first `device_map_share` of the MoE layers on the GPU. "(every expert called)" is the
same run with `empty_calls` 1 (transformers 4.40-4.51 call every expert module): a reference, not the
stand-in, since both figures predate or bypass those versions (Mixtral's was published 2024-02-27,
under transformers <= 4.38, which skip experts without tokens; DeepSeek-V2-Lite runs its own remote
code, whose `moe_infer` skips them too). Every Accelerate copy pays Accelerate's per-byte cost of a
pageable `.to()` (`core.host_costs.ACCELERATE`, measured on an H200 host with its
`torch.cuda.empty_cache()` on every hooked tensor move); DeepSpeed's copies are pinned
(`offload_param.pin_memory`) at ZeRO-3's own hook costs (`core.host_costs.DEEPSPEED`).

At 128 experts per layer: the README's later table gives DeepSpeed 0.16.2 on Qwen3-30B-A3B (48 layers of
128 experts, top 8), 7.857 s/token. Which expert modules ZeRO-3 gathers depends on the transformers version,
which the README does not state: Qwen3-MoE's first releases (4.51.0-4.52.4) loop over every expert with no
skip, so each of a layer's 128 expert modules is called, and ZeRO-3's pre-forward hook gathers its
parameters, with or without tokens; 4.53.0 (built 2025-06-26) loops over the hit experts only; 5.x holds a
layer's experts in one module of 3-D tensors, gathered whole. The stand-in is the first: the same table's
other Qwen3 row is vLLM v0.8.5, whose wheel (built 2025-04-28) requires transformers>=4.51.1, which dates
the Qwen3 runs before 4.53.0. The other two behaviours run beside it as references, not counted. Not
expressed: Switch-large-128 and NLLB-MoE-54B (encoder-decoder models), and Mixtral-offloading's Table 2
(its naive-offloading row runs 2-3-bit HQQ experts).

Measured on a real GPU (`h200_accelerate`): Accelerate's own offload in bench/gpu.py's H200 run, the
model cut to the run's 12 layers, its 32 prompts as one batch at the longest one's length (`generate`
left-pads them), 8 new tokens, on the `h200` preset. transformers 5.x holds a layer's experts in one
module (`fused_experts` 1), and `device_map` offloads whole decoder layers (`offload_dense` 1); the
share is `device_map_share` at the run's max_memory (embedding and layers 0-3 on the GPU: the 5 of 16
entries it recorded). Not expressed: the offloaded final norm and LM head (the head's 262 MB a step, 1.1%
of the 23.5 GB moved per step, uncharged here).
"""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import successor_numbers as N
from flowmoe.study.reproduce.generic_offloader_numbers import (
    H200_ACCELERATE,
    H200_ACCELERATE_TOKENS_PER_S,
    H200_LAYERS,
    H200_LONGEST_PROMPT,
    H200_MAX_MEMORY,
    H200_NEW_TOKENS,
    H200_PROMPTS,
    MOE_INFINITY,
    MOE_INFINITY_LATENCY,
    MOE_INFINITY_LEGACY,
    QWEN3_DEEPSPEED_LATENCY,
)
from flowmoe.study.reproduce.setting import DECODE, Setting, System, paper_setup
from flowmoe.study.simulate import Setup

# DeepSpeed ZeRO-Inference offloads every parameter (weights share 0); batch 1, attention on the GPU
# beside the KV cache, as MoE-Gen's §A.1 runs it.
AT_BATCH_1 = Given(batch_size=1, micro_batches=1, attention_on="gpu", weights_gpu_share=0.0, kv_gpu_share=1.0)
# one module per expert (transformers 4.x); every parameter gathered per step, the dense parts too (ZeRO-3)
HOOKS = evolve(AT_BATCH_1, options={"fused_experts": 0, "offload_dense": 1})
NOTE = (
    "DeepSpeed ZeRO-Inference fetches a module's parameters in its pre-forward hook and releases them "
    "after, the dense parts' too, with nothing prefetched once the experts' order invalidates its trace "
    "(DeepSpeed #4808); it stands in as `zero-inference` (one module per expert, `offload_dense` 1): "
    "Accelerate's plan, its copies from pinned memory (offload_param.pin_memory), priced with ZeRO-3's "
    "measured hook costs (core.host_costs.DEEPSPEED: 205.5 us per module call, 542.8 us per Linear)"
)


# accelerate 0.27's get_balanced_memory: on one GPU, with no max_memory given, "we will use 90% of the
# memory on device 0 for storing the model, and 10% for the buffer"
DEVICE_MAP_STORE = 0.9


def device_map_share(spec: ModelSpec, hw: HardwareSpec, max_memory: float | None = None) -> float:
    """The share of `spec`'s MoE layers that `device_map="auto"` puts on the GPU, as accelerate's
    `infer_auto_device_map` fills it (0.27 to 1.15): modules in order (the input embedding, then whole
    decoder layers, its no-split modules) into `max_memory` less the largest layer, kept free to load an
    offloaded one; a layer that does not fit sends it and every later module to the CPU. Without
    `max_memory`, 90% of the GPU's memory: the preset's whole GPU memory stands for the free memory it
    reads (`torch.cuda.mem_get_info`), at most a layer more than a run with a CUDA context finds room for."""
    store = DEVICE_MAP_STORE * hw.gpu_memory if max_memory is None else max_memory
    layers = [spec.layer_dense_bytes(i) + spec.layer_expert_bytes(i) for i in range(spec.layers)]
    room = store - max(layers) - spec.vocab * spec.hidden * spec.dtype_bytes
    placed = 0
    while placed < spec.layers and layers[placed] <= room:
        room -= layers[placed]
        placed += 1
    moe = [i for i in range(spec.layers) if spec.is_moe_layer(i)]
    return sum(1 for i in moe if i < placed) / len(moe)


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
                System("DeepSpeed", "zero-inference", setup, published, given=HOOKS, metric=DECODE),
                System("DeepSpeed (ideal)", "zero-inference", ideal, None, given=HOOKS, metric=DECODE),
                System("DeepSpeed (on-demand)", "on-demand", ideal, None, given=AT_BATCH_1, metric=DECODE),
            ),
            note=NOTE,
        )
        if not quick:
            yield moe_infinity(model, experts, setup)
    if not quick:
        yield qwen3_deepspeed()
        yield h200_accelerate()


def moe_infinity(model: str, experts: int, setup: Setup) -> Setting:
    """MoE-Infinity README's DeepSpeed and Accelerate rows for `model` on one A5000 (`moe-gen-c1`)."""
    latency = MOE_INFINITY_LATENCY[model]
    auto = evolve(AT_BATCH_1, weights_gpu_share=device_map_share(setup.spec, setup.hardware))
    device_map = evolve(auto, options={"fused_experts": 0, "offload_dense": 1})
    every = evolve(auto, options={"fused_experts": 0, "offload_dense": 1, "empty_calls": 1})
    return Setting(
        "generic-offloaders",
        f"{model} ({experts} experts/layer) DeepSpeed and Accelerate s/token at batch 1 @ one A5000",
        MOE_INFINITY,
        (
            System(
                "DeepSpeed", "zero-inference", setup, 1 / latency["DeepSpeed"], given=HOOKS, metric=DECODE
            ),
            System(
                "Accelerate", "accelerate", setup, 1 / latency["Accelerate"], given=device_map, metric=DECODE
            ),
            System("Accelerate (every expert called)", "accelerate", setup, None, given=every, metric=DECODE),
        ),
        note=f"{NOTE}. Accelerate: device_map='auto' keeps the first "
        f"{auto.weights_gpu_share:.0%} of the MoE layers on the GPU; published as seconds per token, "
        "compared as its inverse",
    )


def qwen3_deepspeed() -> Setting:
    """MoE-Infinity README's DeepSpeed row for Qwen3-30B-A3B (128 experts per layer) on one A5000
    (`moe-gen-c1`), every expert module called (transformers 4.51-4.52), beside the other versions'."""
    setup = paper_setup(preset("qwen3-30b-a3b"), "moe-gen-c1", "fixed:512:32", 32)
    every = evolve(HOOKS, options={**HOOKS.options, "empty_calls": 1})
    fused = evolve(HOOKS, options={**HOOKS.options, "fused_experts": 1})
    return Setting(
        "generic-offloaders",
        "qwen3-30b-a3b (128 experts/layer) DeepSpeed s/token at batch 1 @ one A5000",
        MOE_INFINITY_LEGACY,
        (
            System("DeepSpeed", "zero-inference", setup, 1 / QWEN3_DEEPSPEED_LATENCY, given=every,
                   metric=DECODE),
            System("DeepSpeed (routed experts only: transformers 4.53-4.57)", "zero-inference", setup, None,
                   given=HOOKS, metric=DECODE),
            System("DeepSpeed (fused experts: transformers >= 5)", "zero-inference", setup, None, given=fused,
                   metric=DECODE),
        ),
        note=f"{NOTE}. Every one of a layer's 128 expert modules is called, as transformers 4.51.0-4.52.4's "
        "Qwen3-MoE loop does (no skip of experts without tokens), and ZeRO-3 gathers each called module's "
        "parameters; published as seconds per token, compared as its inverse",
    )  # fmt: skip


def h200_accelerate() -> Setting:
    """Accelerate's offload measured on an H200 (bench/gpu.py's run): the same model cut, batch, device
    map and transformers version, beside the same plan without the hooks' host costs."""
    spec = preset("mixtral-8x7b").with_layers(H200_LAYERS)
    setup = paper_setup(spec, "h200", f"fixed:{H200_LONGEST_PROMPT}:{H200_NEW_TOKENS}", H200_NEW_TOKENS)
    share = device_map_share(spec, setup.hardware, H200_MAX_MEMORY)
    given = Given(batch_size=H200_PROMPTS, micro_batches=1, attention_on="gpu", weights_gpu_share=share,
                  kv_gpu_share=1.0, options={"fused_experts": 1, "offload_dense": 1})  # fmt: skip
    return Setting(
        "generic-offloaders",
        f"mixtral-8x7b x{H200_LAYERS} layers (8 experts/layer) Accelerate offload, {H200_PROMPTS} prompts x "
        f"{H200_NEW_TOKENS} new tokens @ one H200 (measured)",
        H200_ACCELERATE,
        (
            System("Accelerate", "accelerate", setup, H200_ACCELERATE_TOKENS_PER_S, given=given),
            System("Accelerate (ideal)", "accelerate", evolve(setup, host_costs=False), None, given=given),
        ),
        note="transformers 5.x: a layer's experts are one module, all moved per call (`fused_experts` 1); "
        f"device_map keeps the embedding and the first {share:.0%} of the layers on the GPU and offloads the "
        "others whole (`offload_dense` 1); tokens/s over the whole generate call (prefill and new tokens); "
        "the offloaded LM head (262 MB a step) is not charged",
    )
