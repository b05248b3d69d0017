"""`flowmoe run --scheduler auto`: every scheduler simulated on the job's workload, best first.

The workload is the job's own: its prompt lengths (a log-normal with their mean, spread, minimum
and maximum, as the named workloads are) and its max new tokens; the batch is capped at the job's
request count. Each scheduler gets its best policy on the machine's hardware description
(`best_policy`); the fastest that can run is the one to run, with its policy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from attrs import evolve

from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import LengthDistribution, Workload
from flowmoe.study.best_policy import Given, best_policy
from flowmoe.study.sim_report import SimulationResult
from flowmoe.study.simulate import Setup


def job_workload(lengths: Sequence[int], gen: int) -> Workload:
    """A workload with the prompt lengths' mean, log-spread, minimum and maximum."""
    if not lengths:
        raise ConfigError("--scheduler auto: the prompt file has no prompt to simulate")
    logs = [math.log(n) for n in lengths]
    spread = statistics.pstdev(logs) if len(lengths) > 1 else 0.0
    prompt = LengthDistribution(statistics.fmean(lengths), max(lengths), min(lengths), spread)
    return Workload("this job", prompt, gen, (gen,), f"{len(lengths)} prompts of the job")


def rank(
    spec: ModelSpec, hw: HardwareSpec, work: Workload, names: Sequence[str], requests: int, given: Given
) -> list[SimulationResult]:
    """Each scheduler at its best policy, fastest first; those that cannot run last."""
    setup = Setup(spec, hw, work, Policy(gpu_memory=given.gpu_memory), decode_samples=2)
    capped = evolve(given, max_batch=min(requests, given.max_batch or requests))
    results = [best_policy(setup, name, capped) for name in names]
    return sorted(results, key=lambda r: (r.error is not None, -r.throughput))


def choice(results: Sequence[SimulationResult]) -> SimulationResult:
    best = results[0] if results else None
    if best is None or best.error is not None:
        raise ConfigError("--scheduler auto: no scheduler can run this job on this hardware")
    return best
