"""Klotski's settings: Table 3's ablation, its simple pipeline to its multi-batch pipeline with
hot experts first, and Klotski (q): the same pipeline with experts and attention tensors quantized
(§7 "Compression": HQQ, 4 bits, group 64 — flowmoe's hqq4 for both)."""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.study.best_policy import Given
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce.setting import Setting, System, pageable, paper_setup, ratios_from

KLOTSKI_MACHINE = {"Env1": "klotski-env1", "Env2": "klotski-env2"}
# Per-micro-batch size: Table 3 does not state it (§9.1: batch sizes 4-64; §7: "typically a multiple of
# 4"); 8 is the default of Klotski's public code (mindspore-lab/models research/SYSU/Klotski/main.py,
# --gpu-batch-size 8) and the batch size of its correlation-table warm-up (§8).
KLOTSKI_MICRO_BATCH = 8


def klotski(quick: bool) -> Iterator[Setting]:
    for (env, model), rows in P.KLOTSKI_TABLE3.items():
        if quick and model != "mixtral-8x7b":
            continue
        spec, n = preset(model), P.KLOTSKI_GROUP[(env, model)]
        setup = paper_setup(spec, KLOTSKI_MACHINE[env], "fixed:512:32", 32)
        # §6.1: "when sufficient CPU memory is available, we use pin_memory"; where the model does not
        # fit host memory (Env1, Mixtral-8x22B) the CPU weights stay pageable.
        if spec.total_bytes > setup.hardware.cpu_memory:
            setup = pageable(setup)
        # §9.5's simple pipeline, the ablation's first step in Klotski's own framework (its disk tier
        # included): one batch, the whole next MoE layer prefetched while the current one computes.
        every = KlotskiOptions(hot_experts=spec.moe.experts, group_size=1)
        one = Policy(KLOTSKI_MICRO_BATCH, 1, weights_gpu_share=0.0, kv_gpu_share=0.0, options=(every,))
        # §6.1's adaptive placement: the GPU memory the pipeline leaves free keeps weights (and KV)
        # there, so the weight and KV shares are the search's largest that fit; no quantization.
        many = Given(KLOTSKI_MICRO_BATCH * n, n, expert_format="native", options={"group_size": n})
        # §7: "quantize both expert and attention tensors to 4 bits, using a group size of 64"
        quantized = evolve(many, expert_format="hqq4", attention_format="hqq4")
        systems = (
            System("Simple pipeline", "klotski", setup, rows["Simple pipeline"], one),
            System(
                "+ Multi batches",
                "klotski",
                setup,
                rows["+ Multi batches"],
                given=evolve(many, options={**many.options, "hot_experts": spec.moe.experts}),
            ),
            System(
                "Klotski (+ adjust order)", "klotski", setup, rows["Klotski (+ adjust order)"], given=many
            ),
            System("Klotski (q)", "klotski", setup, rows["Klotski (q)"], given=quantized),
        )
        pairs = [
            ("Klotski (+ adjust order)", "Simple pipeline"),
            ("+ Multi batches", "Simple pipeline"),
            ("Klotski (+ adjust order)", "+ Multi batches"),
            ("Klotski (q)", "Klotski (+ adjust order)"),
        ]
        yield Setting(
            "klotski",
            f"Table 3 {env} {model}",
            f"{P.KLOTSKI}, Table 3",
            systems,
            ratios_from(systems, pairs),
            f"n = {n} micro-batches of {KLOTSKI_MICRO_BATCH} (assumed: the public code's default), "
            "prompt 512, gen 32; klotski's expert share on the GPU: the largest that fits (§6.1 "
            "adaptive placement), CPU weights pinned where the model fits host memory (§6.1); "
            "'Simple pipeline' = klotski with one batch (n = 1) prefetching every expert, "
            "'+ Multi batches' = klotski prefetching every expert (K = E); 'Klotski (q)' = klotski "
            "with experts and attention in hqq4 (HQQ, 4 bits, group 64: §7; the same n, Table 3 "
            "gives one per environment); the row '+ Only prefetch hot experts' (klotski always "
            "reorders) is not expressible",
        )
