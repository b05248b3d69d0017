"""Batch-1 local inference (issue 28): Fiddler against the offloaders it was measured with, one request
at a time, on the Fiddler presets (`fiddler-env1`, `fiddler-env2`, the paper's Table 1 machines).

Stand-ins: Fiddler -> `fiddler` with its GPU experts (Table 1) at the 16 CPU threads its code sets;
DeepSpeed-MII (ZeRO-Infinity) -> `zero-inference` with one module per expert, the dense parts moving too
(ZeRO-3 gathers every parameter), pinned copies and ZeRO-3's hook costs, as `generic-offloaders` runs
DeepSpeed;
Mixtral-offloading in 16 bits (Fiddler's port) -> `lru-cache --gpu-misses 1`, 8 - `offload_per_layer`
ways in one set per MoE layer (a miss fetched to the GPU at once, computed there, nothing prefetched).
Every figure is in `batch_one_numbers` with its source.
"""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.study.reproduce import batch_one_numbers as B
from flowmoe.study.reproduce.generic_offloaders import HOOKS
from flowmoe.study.reproduce.lru_cache import FIDDLER_THREADS
from flowmoe.study.reproduce.setting import PREFILL, Setting, Speedup, System, paper_setup
from flowmoe.study.simulate import Setup

README_WORK = "fixed:32:256"  # one of the README's configurations, among its longer outputs (>3 tok/s)
TTFT_LENGTH = 1024  # one of §4.2's prompt lengths; its speedups are averages over 512-4096
NOTE = (
    "DeepSpeed-MII pins its parameters (§4.1: pin_memory): `zero-inference` copies them from pinned "
    "memory at ZeRO-3's measured hook costs (core.host_costs.DEEPSPEED)"
)


def _systems(setup: Setup, env: str, metric: str) -> list[System]:
    ways = 8 - B.FIDDLER_OFFLOAD_PER_LAYER[env]
    one = Policy(1, 1, weights_gpu_share=0.0, attention_on="gpu", kv_gpu_share=1.0)
    cache = one.with_options(LRUCacheOptions(expert_cache_slots=32 * ways, cache_ways=ways, gpu_misses=1))
    fiddler = evolve(one, weights_gpu_share=B.FIDDLER_GPU_EXPERTS[env] / 256, cpu_threads=FIDDLER_THREADS)
    return [
        System("Fiddler", "fiddler", setup, None, fiddler, metric=metric),
        System("Mixtral-offloading", "lru-cache", setup, None, cache, metric=metric),
        System("DeepSpeed-MII", "zero-inference", setup, None, given=HOOKS, metric=metric),
    ]


def batch_one(quick: bool) -> Iterator[Setting]:
    spec = preset("mixtral-8x7b")
    setup = paper_setup(spec, "fiddler-env1", README_WORK, samples=2)
    systems = _systems(setup, "Env1", "tok/s")
    over = B.FIDDLER_README_OVER
    published = B.FIDDLER_README_TPS
    systems[0] = evolve(systems[0], published=published)
    systems[1:] = [evolve(s, implied=published / over[s.name]) for s in systems[1:]]
    yield Setting(
        "batch-one",
        f"mixtral-8x7b, one request, Env1 (Quadro RTX 6000 + Xeon Gold 6126), {README_WORK}",
        f"{B.FIDDLER_README}, its opening line and § Benchmarks",
        tuple(systems),
        tuple(Speedup("Fiddler", name, ratio) for name, ratio in over.items()),
        f"end-to-end tokens/s (generated / (prefill + decode)); the README's '>3 token/s' is a lower bound "
        f"and its speedups are means over 24 input x output configurations, compared at {README_WORK}; "
        f"{NOTE}",
    )
    if quick:
        return
    for env in ("Env1", "Env2"):
        work = f"fixed:{TTFT_LENGTH}:1"
        setup = paper_setup(spec, f"fiddler-{env.lower()}", work, samples=1)
        yield Setting(
            "batch-one",
            f"mixtral-8x7b, one request's prefill (TTFT), {env}, prompt {TTFT_LENGTH}",
            f"{B.FIDDLER}, §4.2 (Fig. 5)",
            tuple(_systems(setup, env, PREFILL)),
            tuple(Speedup("Fiddler", name, ratio) for name, ratio in B.FIDDLER_TTFT_OVER.items()),
            f"prefill tokens/s (TTFT inverted); the published speedups are means over prompts of "
            f"{', '.join(map(str, B.FIDDLER_TTFT_LENGTHS))} tokens and both environments, compared "
            f"with each; {NOTE}",
        )
