"""`flowmoe reproduce`: the source papers' and their successors' published numbers next to the
simulator's, setting by setting; the registry of the papers.

A setting is one published configuration (machine, model, workload) and the systems the paper ran
on it, each mapped to the flowmoe scheduler that stands in for it and to the policy the paper states
(μ, N/μ, weight share) or, where it states none, the best policy that fits that scheduler
(`best_policy`, the search `flowmoe simulate` runs). Every number compared is in `paper_numbers`
(the five source papers) or `successor_numbers` (MoE-Gen, HybriMoE, KTransformers, Fate) with its
table, figure or section; one module per paper builds its settings (`setting` holds their types),
`run` runs them. For each setting the report gives the paper's and the simulated figure per system
with their ratio and the lane that bounds the run, the speedups between systems (paper vs
simulated), and whether the simulated ranking equals the paper's. Nothing here is tuned to a
published end-to-end number; machines are the hardware presets of the papers' hosts, and the
collaborative-inference host per thread count takes its CPU expert time from that paper's own
microbenchmark (Table III), not from its end-to-end results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flowmoe.study.reproduce import (
    batch_one,
    fate,
    fiddler,
    generic_offloaders,
    hybrimoe,
    klotski,
    ktransformers,
    lru_cache,
    moe_gen,
    moe_lightning,
    pre_gated,
)
from flowmoe.study.reproduce.setting import Setting

BUILDERS: dict[str, Callable[[bool], Iterator[Setting]]] = {
    "moe-lightning": moe_lightning.moe_lightning,
    "klotski": klotski.klotski,
    "lru-cache": lru_cache.lru_cache,
    "pre-gated": pre_gated.pre_gated,
    "fiddler": fiddler.fiddler,
    "moe-gen": moe_gen.moe_gen,
    "hybrimoe": hybrimoe.hybrimoe,
    "ktransformers": ktransformers.ktransformers,
    "fate": fate.fate,
    "generic-offloaders": generic_offloaders.generic_offloaders,
    "batch-one": batch_one.batch_one,
}
SUCCESSORS = ("moe-gen", "hybrimoe", "ktransformers", "fate")
PAPERS = (
    "moe-lightning",
    "klotski",
    "lru-cache",
    "pre-gated",
    "fiddler",
    *SUCCESSORS,
    "generic-offloaders",
    "batch-one",
)


def settings(paper: str, quick: bool = False) -> list[Setting]:
    names = PAPERS if paper == "all" else (paper,)
    return [s for name in names for s in BUILDERS[name](quick)]
