"""Workloads: published averages and bounds, deterministic sampling, fixed lengths, bad names."""

from __future__ import annotations

import statistics

import pytest

from flowmoe.core.errors import ConfigError
from flowmoe.core.workloads import WORKLOADS, LengthDistribution, workload

PUBLISHED = [("mtbench", 77, 418, 128), ("reasoning", 242, 256, 50), ("summarization", 1693, 1984, 64)]


@pytest.mark.parametrize(("name", "mean", "top", "gen"), PUBLISHED)
def test_named_workloads_match_the_published_lengths(name: str, mean: int, top: int, gen: int) -> None:
    work = workload(name)
    lengths = work.sample(20000, seed=3)
    assert max(lengths) <= top and min(lengths) >= work.prompt.minimum
    assert statistics.mean(lengths) == pytest.approx(mean, rel=0.03)
    assert work.prompt.clipped_mean(work.prompt._location()) == pytest.approx(mean, rel=1e-6)
    assert work.gen_len == gen


def test_sampling_is_deterministic_per_seed() -> None:
    work = WORKLOADS["mtbench"]
    assert work.sample(64, seed=1) == work.sample(64, seed=1)
    assert work.sample(64, seed=1) != work.sample(64, seed=2)
    assert work.sample(8, seed=1) == work.sample(64, seed=1)[:8]


def test_fixed_and_generation_override() -> None:
    work = workload("fixed:512:32")
    assert work.sample(5) == [512] * 5 and work.gen_len == 32
    assert workload("mtbench").with_gen_len(256).gen_len == 256


@pytest.mark.parametrize("name", ["nope", "fixed:0:32", "fixed:512", "fixed:a:b"])
def test_bad_workload_names(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown workload"):
        workload(name)


def test_bad_distributions_and_counts() -> None:
    with pytest.raises(ConfigError, match="min <= mean <= max"):
        LengthDistribution(500, 418)
    with pytest.raises(ConfigError, match="spread"):
        LengthDistribution(77, 418, 1, -1.0)
    with pytest.raises(ConfigError, match="at least one request"):
        workload("mtbench").sample(0)
    with pytest.raises(ConfigError, match="generation length"):
        workload("mtbench").with_gen_len(0)
