"""Fiddler's settings: the expert hit rate of popularity placement against random placement."""

from __future__ import annotations

from collections.abc import Iterator

from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.reproduce.setting import Setting, System, paper_setup


def fiddler(quick: bool) -> Iterator[Setting]:
    spec = preset("mixtral-8x7b")
    for env, (kept, best, random) in P.FIDDLER_HIT.items():
        if quick and env != "Env1":
            continue
        setup = paper_setup(spec, f"fiddler-{env.lower()}", "fixed:128:64", samples=8)
        policy = Policy(1, 1, weights_gpu_share=kept / 256)
        systems = (
            System("popular experts (profiled)", "fiddler", setup, best, policy, metric="hit rate"),
            System("random experts", "fiddler", setup, random, policy, metric="hit rate", profile=False),
        )
        yield Setting(
            "fiddler",
            f"hit rate, {env} ({kept} of 256 experts on the GPU)",
            f"{P.FIDDLER}, Appendix C",
            systems,
            (),
            "synthetic routing (flowmoe's default skew 0.5); 'random' = no routing profile",
        )
