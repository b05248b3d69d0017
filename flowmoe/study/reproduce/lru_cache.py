"""The CPU-GPU collaborative inference paper's settings (`lru-cache`): its set-associative expert cache
against prefetching, CPU-only and Fiddler, per CPU thread count."""

from __future__ import annotations

from collections.abc import Iterator

from attrs import evolve

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.hardware import HardwareSpec, hardware
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.spec import ModelSpec
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce.setting import Setting, Speedup, System, paper_setup

COLLAB_WORK = "fixed:32:64"  # assumed: the paper runs single requests and states no lengths
FIDDLER_THREADS = 16  # the CPU threads Fiddler's code sets (efeslab/fiddler, torch.set_num_threads(16))
WAYS = (2, 4, 8)  # the cache configurations tried: (indexes, ways) of the slots (§III-B, Fig. 5)


def cache_configs(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(indexes, ways) for each of WAYS: the slots of §III-B's formula, S = available GPU memory /
    expert size, with the memory that holds 56 Mixtral-8x7B experts; at most one index per layer."""
    slots = P.COLLAB_SLOTS * preset("mixtral-8x7b").expert_bytes // spec.expert_bytes
    return tuple((min(spec.layers, slots // ways), ways) for ways in WAYS)


def threads_host(threads: int, spec: ModelSpec, model: P.CollabModel) -> HardwareSpec:
    """The collaborative-inference host with its CPU at `threads` OpenMP threads: the bytes of a
    layer's top-k experts over the paper's measured CPU time (Table III, "Mixtral 8x7B FFN" in its
    Table I). Read per expert instead, its own §IV-B statements could not hold (CPU-only ahead of
    prefetching at 2-4 threads, its cache 15-35% over CPU-only), so the time is read per layer."""
    hw = hardware("collab-4090")
    rate = spec.moe.top_k * spec.expert_bytes / (model.expert_ms[threads] / 1e3)
    return evolve(hw, name=f"collab-4090 ({threads} threads)", cpu_gemm_efficiency=rate / hw.cpu_bandwidth)


def collab_specs() -> tuple[list[tuple[str, ModelSpec]], str]:
    """The paper's models flowmoe can express, and a note on the one it cannot (no model family)."""
    specs = [("mixtral-8x7b", preset("mixtral-8x7b"))]
    try:
        specs.append(("phi-3.5-moe", preset("phi-3.5-moe")))
    except FlowmoeError as exc:
        return specs, f"Phi-3.5-MoE (Fig. 5b, Tables III-V) not run: {exc}"
    return specs, "Phi-3.5-MoE's slots from §III-B's formula (the memory of 56 Mixtral experts)"


def lru_cache(quick: bool) -> Iterator[Setting]:
    specs, phi = collab_specs()
    for key, spec in specs[:1] if quick else specs:
        model, mixtral = P.COLLAB_MODELS[key], key == "mixtral-8x7b"
        for threads in (24,) if quick else P.THREADS:
            yield _collab_setting(key, spec, model, threads, mixtral, phi)


def _collab_setting(
    key: str, spec: ModelSpec, model: P.CollabModel, threads: int, mixtral: bool, phi: str
) -> Setting:
    setup = paper_setup(spec, threads_host(threads, spec, model), COLLAB_WORK, samples=8)
    one = Policy(1, 1, weights_gpu_share=0.0, cpu_threads=threads)
    ours = model.ours(threads)
    systems = [
        System("Ours (best cache)", "lru-cache", setup, ours, one, cache_sweep=True),
        System("Prefetching (Pre-gated)", "pre-gated", setup, model.prefetch_tps, one),
    ]
    speedups = [Speedup("Ours (best cache)", "Prefetching (Pre-gated)", ours / model.prefetch_tps)]
    if mixtral:  # §IV-B's CPU-only, Fiddler and (29, 2) figures are Mixtral-8x7B's
        middle = sum(P.COLLAB_OVER_CPU_ONLY) / 2
        cpu_only = evolve(one, ffn_on="cpu")
        systems.append(System("CPU only", "fiddler", setup, None, cpu_only, implied=ours / middle))
        speedups.append(Speedup("Ours (best cache)", "CPU only", middle, *P.COLLAB_OVER_CPU_ONLY))
    if mixtral and threads == 24:
        # Fiddler's generate() fixes PyTorch's CPU threads at 16 whatever the host offers, and computes
        # its CPU experts with PyTorch as the paper's own framework does (efeslab/fiddler,
        # src/fiddler/mixtral.py: torch.set_num_threads(16), run_expert_at_cpu): Table III at 16.
        at = FIDDLER_THREADS
        host = evolve(setup, hardware=threads_host(at, spec, model))
        fiddler = evolve(one, weights_gpu_share=56 / 256, cpu_threads=at)
        systems.append(System("Fiddler", "fiddler", host, ours / P.COLLAB_OVER_FIDDLER, fiddler))
        speedups.append(Speedup("Ours (best cache)", "Fiddler", P.COLLAB_OVER_FIDDLER))
        cache = one.with_options(LRUCacheOptions(expert_cache_slots=58, cache_ways=2))
        systems.append(System("Ours (29, 2)", "lru-cache", setup, P.COLLAB_29_2_CAP, cache))
    configs = ", ".join(map(str, cache_configs(spec)))
    return Setting(
        "lru-cache",
        f"{key}, {threads} CPU threads",
        f"{P.COLLAB}, Tables III-V, §IV-B",
        tuple(systems),
        tuple(speedups),
        f"batch 1, {COLLAB_WORK} (assumed); ours = the best of the cache configurations {configs} as "
        f"the paper picks per thread count; {phi}",
    )
