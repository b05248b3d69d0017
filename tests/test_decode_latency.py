"""Per-token decode latency and the plan's choices in a simulation's result (issue 28): the mean and
p50/p90 of the decode steps' times, how many experts the GPU holds per MoE layer, where decode ran
attention and the experts, and in `simulate --json` which policy fields the search chose."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from attrs import evolve

from flowmoe.cli import main
from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.study.sim_report import TokenLatency
from flowmoe.study.simulate import Setup, Simulation
from tests.schedule_fixtures import PAGES_8K, TINY_CONFIG

SPEC = ModelSpec.from_hf(TINY_CONFIG)  # 2 MoE layers of 4 experts


def setup(policy: Policy, gen: int = 9, samples: int = 0) -> Setup:
    work = workload("fixed:64:2").with_gen_len(gen)
    return Setup(SPEC, hardware("t4"), work, policy, RoutingModel(seed=1), decode_samples=samples)


def test_token_latency_is_the_mean_and_percentiles_of_the_steps() -> None:
    latency = TokenLatency.of([float(s) for s in range(1, 11)])
    assert latency == TokenLatency(5.5, 5.5, pytest.approx(9.1))
    assert TokenLatency.of([0.25]) == TokenLatency(0.25, 0.25, 0.25)
    assert TokenLatency.of([]) is None


def test_every_decode_step_simulated_gives_each_its_own_time() -> None:
    """With every decode step simulated, the latency is over the runs' own step times; the contexts
    grow step by step, so the later steps are no faster."""
    sim = Simulation(setup(Policy(1, 1, weights_gpu_share=1.0)))
    result = sim.run("eager")
    latency = result.token_latency
    assert latency is not None and result.error is None
    assert latency.mean * sim.decode_count == pytest.approx(result.decode_seconds)
    assert latency.p50 <= latency.p90
    decoded = result.generated - result.sequences  # one sequence: its decode tokens / their time
    assert latency.mean == pytest.approx(result.decode_seconds / decoded)


def test_sampled_decode_steps_are_interpolated_as_the_decode_time_is() -> None:
    policy = Policy(2, 2, weights_gpu_share=0.0, options=PAGES_8K)
    every = Simulation(setup(policy, gen=17)).run("on-demand")
    sampled = Simulation(setup(policy, gen=17, samples=3)).run("on-demand")
    assert sampled.token_latency is not None and every.token_latency is not None
    assert sampled.token_latency.mean * 16 == pytest.approx(sampled.decode_seconds)
    assert sampled.token_latency.mean == pytest.approx(every.token_latency.mean, rel=0.05)


def test_a_prefill_only_run_has_no_token_latency() -> None:
    result = Simulation(setup(Policy(1, 1, weights_gpu_share=1.0), gen=1)).run("eager")
    assert result.error is None and result.token_latency is None


def test_gpu_experts_are_a_caches_slots_or_those_resident() -> None:
    resident = Simulation(setup(Policy(1, 1, weights_gpu_share=1.0))).run("eager")
    assert (resident.gpu_experts, resident.experts_per_layer, resident.cpu_experts) == (8, 4.0, 0.0)
    # lru-cache's S slots fill S // M indexes of M ways, one MoE layer each: 8 slots of 4 ways -> 2 layers
    options = LRUCacheOptions(page_bytes=8192, expert_cache_slots=8, cache_ways=4)
    cache = Policy(1, 1, weights_gpu_share=0.0, options=(options,))
    lru = Simulation(setup(cache)).run("lru-cache")
    assert (lru.gpu_experts, lru.experts_per_layer) == (8, 4.0)
    half = evolve(cache, options=(LRUCacheOptions(page_bytes=8192, expert_cache_slots=2, cache_ways=2),))
    one_layer = Simulation(setup(half)).run("lru-cache")  # one index: layer 0 cached, layer 1 on the CPU
    assert (one_layer.gpu_experts, one_layer.experts_per_layer) == (2, 1.0)
    assert one_layer.cpu_experts is not None and 0 < one_layer.cpu_experts < 1
    assert one_layer.cpu_attention == 0.0
    assert dict(one_layer.report)["expert_cache_slots"] == 2.0


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


def test_simulate_json_has_the_latency_and_what_the_search_chose(
    tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--model", tiny_model, "--workload", "fixed:6:4", "--scheduler", "lru-cache",
            "--batch-size", "1", "--micro-batches", "1", "--expert-cache-slots", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen_by_search"] == ["attention_on", "ffn_on", "kv_gpu_share"]
    assert data["pinned_by"]["kv_gpu_share"] == "--kv-gpu-share"
    (result,) = data["results"]
    latency = result["token_latency_seconds"]
    assert latency["p50"] <= latency["p90"] and latency["mean"] * 3 == pytest.approx(result["decode_seconds"])
    assert result["gpu_experts"] == 4 and result["gpu_experts_per_layer"] == 2.0
    assert result["scheduler_report"]["expert_cache_slots"] == 4.0
    assert 0.0 <= result["decode_experts_cpu_share"] <= 1.0


def test_the_table_marks_what_the_search_chose(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", tiny_model, "--workload", "fixed:6:4", "--scheduler", "eager",
            "--batch-size", "2", "--attention-on", "gpu"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("eager") and "x" in line)
    cells = row.split()
    assert cells[4] == "2" and cells[6] == "gpu"  # given: unmarked
    assert cells[5].endswith("*") and cells[7].endswith("*")  # micro-batches and ffn: the search's
    assert statistics.fmean(float(c) for c in cells[1:4]) > 0
    assert "--expert-cache-slots" in text and "docs/simulator.md" in text
