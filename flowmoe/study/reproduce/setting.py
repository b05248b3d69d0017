"""A setting of `flowmoe reproduce` and what it holds (systems, published speedups and averages), and the
helpers every paper builds its settings with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from attrs import Factory, evolve, frozen

from flowmoe.core.hardware import HardwareSpec, hardware
from flowmoe.core.policy import ExpertFormat, Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study.best_policy import Given
from flowmoe.study.simulate import Setup

ROUTING = RoutingModel(skew=0.5, correlation=0.3)  # flowmoe's defaults (`flowmoe simulate`)
DECODE, PREFILL = "decode tok/s", "prefill tok/s"  # metrics of one phase (`run.measured`)
# the nearest flowmoe expert format to a paper's 4-bit experts (HybriMoE §V, Fate)
NEAREST_INT4: ExpertFormat = "fp8"


@frozen
class System:
    """One system of a setting: the flowmoe scheduler standing in for it, on which setup, the policy
    (None: the scheduler's best that fits `given`), and its published figure (None: none given)."""

    name: str
    scheduler: str
    setup: Setup
    published: float | None
    policy: Policy | None = None
    given: Given = Factory(Given)
    metric: str = "tok/s"  # or "hit rate", DECODE, PREFILL
    profile: bool = True  # False: the scheduler gets no routing profile (popularity)
    cache_sweep: bool = False  # lru-cache: the fastest of `cache_configs`, as the paper picks
    implied: float | None = None  # a figure the paper gives only as a ratio to another: ranking only


@frozen
class Speedup:
    """A published ratio between two systems of a setting (faster / slower); with `over`, a
    statistic ("mean" or "max") of the ratios of those (faster, slower) pairs, as a paper averages
    a speedup over its configurations (`faster` and `slower` then only label it)."""

    faster: str
    slower: str
    published: float
    low: float | None = None  # where the paper gives a range
    high: float | None = None
    over: tuple[tuple[str, str], ...] = ()
    statistic: Literal["mean", "max"] = "mean"


@frozen
class Mean:
    """A published average of several systems' figures (a paper's "average over all
    configurations"), compared with the mean of their simulated figures."""

    name: str
    of: tuple[str, ...]
    published: float


@frozen
class Setting:
    paper: str
    name: str
    where: str
    systems: tuple[System, ...]
    speedups: tuple[Speedup, ...] = ()
    note: str = ""
    means: tuple[Mean, ...] = ()


def paper_setup(
    spec: ModelSpec, hw: HardwareSpec | str, work: str, gen: int | None = None, samples: int = 2
) -> Setup:
    """The setup of a paper's run: `spec` on `hw` (a preset's name or a spec) running the workload
    `work`, its generation length set to `gen`, `samples` decode steps simulated."""
    w = workload(work)
    hw = hardware(hw) if isinstance(hw, str) else hw
    return Setup(spec, hw, w.with_gen_len(gen) if gen else w, Policy(), ROUTING, decode_samples=samples)


def pageable(setup: Setup) -> Setup:
    """The setup for a system whose CPU weights are pageable: MoE-Lightning stages its pages through
    pinned buffers (Appendix A: "weights are first moved from CPU memory to pinned memory"), and its
    FlexGen port builds its policy with `pin_weight=False` (artifact
    benchmarks/flexgen/mtbench_run_8x7b_moe.py). DeepSpeed Zero-Inference pins them (§5.1)."""
    return evolve(setup, weights_pinned=False)


def ratios_from(systems: Sequence[System], pairs: Sequence[tuple[str, str]]) -> tuple[Speedup, ...]:
    """The published speedups of `pairs` (faster, slower) where the paper gives both figures."""
    figure = {s.name: s.published for s in systems if s.published}
    return tuple(Speedup(a, b, figure[a] / figure[b]) for a, b in pairs if a in figure and b in figure)
