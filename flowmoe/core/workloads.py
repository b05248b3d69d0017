"""Workloads: prompt and generation lengths as distributions, sampled deterministically from a seed.

The named workloads are the ones MoE-Lightning evaluates on: MTBench (prompts
of 77 tokens on average, at most 418; generation 32 to 256), HELM synthetic
reasoning (242 / 256, generation 50) and HELM summarization (1693 / 1984,
generation 64). Prompt lengths follow a log-normal clipped to [min, max] whose
location is solved so the clipped mean is the published average.
`fixed:PROMPT:GEN` is a workload of equal lengths (e.g. `fixed:512:32`).
"""

from __future__ import annotations

import math
import random

from attrs import evolve, frozen

from flowmoe.core.errors import ConfigError


@frozen
class LengthDistribution:
    mean: float
    maximum: int
    minimum: int = 1
    spread: float = 0.0  # sigma of the log-normal; 0: every length is the mean

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.minimum <= self.mean <= self.maximum:
            raise ConfigError(
                f"lengths need 1 <= min <= mean <= max, got {self.minimum}/{self.mean}/{self.maximum}"
            )
        if self.spread < 0:
            raise ConfigError(f"length spread must be >= 0, got {self.spread}")

    def sample(self, count: int, rng: random.Random) -> list[int]:
        if self.spread == 0:
            return [round(self.mean)] * count
        mu = self._location()
        return [min(self.maximum, max(self.minimum, round(rng.lognormvariate(mu, self.spread))))
                for _ in range(count)]  # fmt: skip

    def clipped_mean(self, mu: float) -> float:
        """E[clip(X, min, max)] for X ~ LogNormal(mu, spread)."""
        s, lo, hi = self.spread, math.log(self.minimum), math.log(self.maximum)
        inside = math.exp(mu + s * s / 2) * (_phi((hi - mu - s * s) / s) - _phi((lo - mu - s * s) / s))
        below = self.minimum * _phi((lo - mu) / s)
        above = self.maximum * (1 - _phi((hi - mu) / s))
        return inside + below + above

    def _location(self) -> float:
        lo, hi = math.log(self.minimum) - 10 * self.spread, math.log(self.maximum) + 10 * self.spread
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.clipped_mean(mid) < self.mean else (lo, mid)
        return (lo + hi) / 2


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@frozen
class Workload:
    name: str
    prompt: LengthDistribution
    gen_len: int
    gen_choices: tuple[int, ...] = ()  # the generation lengths the papers ran
    source: str = ""

    def __attrs_post_init__(self) -> None:
        if self.gen_len < 1:
            raise ConfigError(f"generation length must be at least 1, got {self.gen_len}")

    def with_gen_len(self, gen_len: int) -> Workload:
        return evolve(self, gen_len=gen_len)

    def sample(self, count: int, seed: int = 0) -> list[int]:
        """Prompt lengths of `count` requests; the same seed gives the same lengths."""
        if count < 1:
            raise ConfigError(f"a batch needs at least one request, got {count}")
        return self.prompt.sample(count, random.Random(f"{self.name}:{seed}"))


WORKLOADS: dict[str, Workload] = {
    "mtbench": Workload("mtbench", LengthDistribution(77, 418, 4, 0.8), 128, (32, 64, 128, 256),
                        "MoE-Lightning: MTBench prompts avg 77 / max 418 tokens, generation 32-256"),
    "reasoning": Workload("reasoning", LengthDistribution(242, 256, 200, 0.05), 50, (50,),
                          "MoE-Lightning: HELM synthetic reasoning, prompts 242 avg / 256 max, gen 50"),
    "summarization": Workload("summarization", LengthDistribution(1693, 1984, 1000, 0.12), 64, (64,),
                              "MoE-Lightning: HELM summarization, prompts 1693 avg / 1984 max, gen 64"),
}  # fmt: skip


def workload(name: str) -> Workload:
    """A named workload, or `fixed:PROMPT:GEN`."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if name.startswith("fixed:"):
        parts = name.split(":")
        if len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            prompt, gen = int(parts[1]), int(parts[2])
            return Workload(name, LengthDistribution(prompt, prompt, prompt), gen, (gen,), "fixed lengths")
    raise ConfigError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)} or fixed:PROMPT:GEN")
