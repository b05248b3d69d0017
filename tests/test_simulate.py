"""Workload simulation: batch steps, decode sampling, synthetic and recorded routing, memory checks,
and the `simulate`, `compare`, `plan` and `run --record-routing` commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from attrs import evolve

from flowmoe.cli import main
from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.memory import kv_bytes
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.routing_trace import RoutingTrace, replay
from flowmoe.core.scheduling import NodeFactory, SchedulerContext
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel, SyntheticRouting, observed_popularity
from flowmoe.core.workloads import workload
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.schedulers.registry import available, create
from flowmoe.study.auto_choice import choice, job_workload
from flowmoe.study.sim_report import interpolate
from flowmoe.study.simulate import Setup, Simulation, batch_steps, sampled
from flowmoe.traces.chrome import validate_chrome
from flowmoe.traces.summary import summarize
from tests.schedule_fixtures import PAGES_8K, TINY_CONFIG

SPEC = ModelSpec.from_hf(TINY_CONFIG)
POLICY = Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.0, options=PAGES_8K)


def setup(**changes: object) -> Setup:
    base = Setup(SPEC, hardware("t4"), workload("mtbench").with_gen_len(6), POLICY, RoutingModel(seed=1))
    return evolve(base, **changes)


def test_batch_steps() -> None:
    steps = batch_steps([5, 3, 4], gen=3, micro_batch=2)
    assert [s.prefill for s in steps] == [True, False, False]
    first, second = steps[0].micro_batches
    assert (first.tokens, first.kv_tokens, second.tokens) == (8, 8, 4)
    decode = steps[2].micro_batches[0]
    assert (decode.tokens, decode.kv_tokens, decode.attended) == (2, 5 + 2 + 3 + 2, 7 + 5)


def test_sampled_steps_and_interpolation() -> None:
    assert sampled(10, 0) == list(range(10)) and sampled(3, 8) == [0, 1, 2]
    assert sampled(31, 4) == [0, 10, 20, 30] and sampled(5, 1) == [0]
    at = sampled(31, 4)
    assert interpolate([2.0 + 3 * a for a in at], at, 31) == pytest.approx(
        sum(2.0 + 3 * i for i in range(31))
    )
    assert interpolate([7.0], [0], 5) == 35.0


def test_synthetic_routing_counts_skew_and_correlation() -> None:
    steps = batch_steps([40] * 8, gen=2, micro_batch=8)
    trace = SyntheticRouting(SPEC, RoutingModel(seed=2)).trace(steps)
    assert trace.counts == SyntheticRouting(SPEC, RoutingModel(seed=2)).trace(steps).counts
    for (_step, _layer, mb), counts in trace.counts.items():
        tokens = steps[_step].micro_batches[mb].tokens
        assert sum(n for _e, n in counts.counts) == tokens * SPEC.moe.top_k
        assert all(0 < n <= tokens for _e, n in counts.counts)
    flat, skewed = (SyntheticRouting(SPEC, RoutingModel(skew=s)).popularity for s in (0.0, 2.0))
    assert max(flat[0]) == pytest.approx(0.25) and max(skewed[0]) > 0.6
    one = evolve(SPEC, moe=evolve(SPEC.moe, top_k=1))
    follow = SyntheticRouting(one, RoutingModel(correlation=1.0, max_tokens=1000))
    both = follow.trace(batch_steps([1], gen=1, micro_batch=1))
    first, second = (both.counts[(0, layer, 0)].experts[0] for layer in (0, 1))
    assert second == follow.successor[1][first]


def test_eager_prefill_is_the_sum_of_its_node_costs() -> None:
    """One lane, no overlap: the simulated prefill takes exactly the nodes' roofline costs."""
    sim = Simulation(setup(decode_samples=0))
    result = sim.run("eager")
    cost = RooflineCost(hardware("t4"), SPEC)
    scheduler = create("eager", SchedulerContext(SPEC, sim.policy, NodeFactory(SPEC)))
    nodes = list(replay(scheduler.plan(sim.steps[0]), lambda r: sim.trace.answer(0, r)))
    assert result.prefill_seconds == pytest.approx(sum(cost(n) for n in nodes), rel=1e-9)
    assert result.throughput == pytest.approx(
        result.generated / (result.prefill_seconds + result.decode_seconds)
    )
    assert result.simulated_steps == 6 and result.generated == 4 * 6


@pytest.mark.parametrize("name", sorted(available()))
def test_every_scheduler_simulates_a_batch(name: str) -> None:
    result = Simulation(setup()).run(name)
    assert result.error is None, result.error
    assert result.throughput > 0 and result.prefill_seconds > 0 and result.decode_seconds > 0
    for lane in result.lanes:
        assert 0 < lane.busy_seconds <= result.seconds * (1 + 1e-9) + 1e-8  # spans on whole nanoseconds


def test_a_policy_over_the_gpu_budget_is_reported_not_run() -> None:
    result = Simulation(setup(policy=evolve(POLICY, gpu_memory=1000))).run("eager")
    assert result.error is not None and "over the" in result.error and result.throughput == 0.0


def test_recorded_routing_is_replayed_or_resampled(tmp_path: Path) -> None:
    sim = Simulation(setup())
    path = tmp_path / "routing.jsonl"
    sim.trace.save(path)
    recorded = RoutingTrace.load(path)
    replayed = Simulation(setup(recorded=recorded))
    assert replayed.trace is recorded
    assert replayed.run("eager").throughput == pytest.approx(sim.run("eager").throughput)
    longer = Simulation(setup(recorded=recorded, workload=workload("mtbench").with_gen_len(12)))
    assert longer.trace is not recorded and longer.run("eager").error is None
    shares = observed_popularity(SPEC, recorded)
    assert all(s is not None and sum(s) == pytest.approx(1.0) for s in shares)


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


def test_simulate_json(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--model", tiny_model, "--workload", "fixed:6:4", "--scheduler", "eager",
                 "--batch-size", "4", "--micro-batches", "2", "--json"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    (result,) = data["results"]
    assert result["scheduler"] == "eager" and result["throughput_tokens_per_second"] > 0
    assert result["generated_tokens"] == 16 and {lane["lane"] for lane in result["lanes"]} == {"gpu.compute"}


def test_compare_writes_a_group_per_scheduler(tiny_model: str, tmp_path: Path) -> None:
    names = sorted(available())[:3]
    trace = tmp_path / "compare.json"
    code = main(["compare", "--model", tiny_model, "--workload", "fixed:6:4", "--schedulers", ",".join(names),
                 "--batch-size", "4", "--micro-batches", "2", "--trace", str(trace)])  # fmt: skip
    assert code == 0
    data = json.loads(trace.read_text())
    assert not validate_chrome(data)
    assert sorted(s.group for s in summarize(data)) == names


def test_compare_without_trace_writes_nothing(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = ["compare", "--model", tiny_model, "--workload", "fixed:6:4", "--schedulers", "eager,on-demand"]
    assert main([*argv, "--batch-size", "2", "--json"]) == 0
    assert list(work.iterdir()) == []


def simulated_policy(
    tiny_model: str, scheduler: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> dict:
    argv = ["simulate", "--model", tiny_model, "--workload", "fixed:6:4", "--scheduler", scheduler,
            "--decode-samples", "1", "--json", *flags]  # fmt: skip
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["error"] is None, result["error"]
    return result["policy"]


# Each simulate flag, alone, and the policy field the result row must show for it.
FLAGS = [
    ("on-demand", ["--batch-size", "6"], {"batch_size": 6}),
    ("klotski", ["--micro-batches", "3"], {"micro_batches": 3}),
    ("flexgen", ["--attention-on", "cpu"], {"attention_on": "cpu"}),
    ("fiddler", ["--ffn-on", "cpu"], {"ffn_on": "cpu"}),
    ("lru-cache", ["--weights-gpu-share", "0.3"], {"weights_gpu_share": 0.3}),
    ("flexgen", ["--kv-gpu-share", "0.25"], {"kv_gpu_share": 0.25}),
    ("on-demand", ["--gpu-memory", "3GiB"], {"gpu_memory": 3 * 2**30}),
    (
        "lru-cache",
        ["--expert-cache-slots", "4", "--cache-ways", "2"],
        {"expert_cache_slots": 4, "cache_ways": 2},
    ),
    ("klotski", ["--group-size", "2"], {"group_size": 2}),
    ("klotski", ["--hot-experts", "1"], {"hot_experts": 1}),
    ("cgopipe", ["--page-size", "128KiB"], {"page_bytes": 128 * 2**10}),
    ("fiddler", ["--cpu-threads", "3"], {"cpu_threads": 3}),
]


@pytest.mark.parametrize(("scheduler", "flags", "expected"), FLAGS, ids=[f[1][0] for f in FLAGS])
def test_every_simulate_flag_is_honoured(
    tiny_model: str, scheduler: str, flags: list[str], expected: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = simulated_policy(tiny_model, scheduler, flags, capsys)
    assert {k: policy[k] for k in expected} == expected


def test_fields_not_given_come_from_the_scheduler_search(
    tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Micro-batches alone are honoured and the batch size is the search's, not a fixed default."""
    policy = simulated_policy(tiny_model, "on-demand", ["--micro-batches", "2"], capsys)
    assert policy["micro_batches"] == 2 and policy["batch_size"] > 16


def test_a_scheduler_that_cannot_run_gets_one_reason(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "mixtral-8x7b", "--layers", "2", "--hardware", "t4", "--workload",
            "fixed:8:2", "--scheduler", "eager,on-demand", "--gpu-memory", "2GiB", "--decode-samples",
            "1"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    results = {r["scheduler"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert "over the 2.0 GiB GPU" in results["eager"]["error"]
    assert results["on-demand"]["error"] is None and results["on-demand"]["throughput_tokens_per_second"] > 0


def test_plan_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "roofline.png"
    argv = ["plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--gen-len", "64", "--max-batch", "1024"]
    code = main([*argv, "--json", "--plot", str(plot)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["batch_size"] <= 1024 and data["best"]["throughput_tokens_per_second"] > 0
    l4 = hardware("l4")  # the sustained CPU peak over the sustained pinned link
    assert data["p1"] == pytest.approx(l4.cpu_flops * l4.cpu_compute_efficiency / l4.h2d_bandwidth)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "mixtral-8x7b", "--hardware", "nope"], "unknown hardware"),
        (["plan", "--model", "mixtral-8x7b", "--workload", "nope"], "unknown workload"),
        (["plan", "--model", "mixtral-8x7b", "--hardware", "missing.json"], "hardware profile not found"),
        (
            ["simulate", "--model", "mixtral-8x7b", "--scheduler", "nope", "--batch-size", "2"],
            "unknown scheduler",
        ),
        (
            ["simulate", "--model", "mixtral-8x7b", "--batch-size", "2", "--routing", "none.jsonl"],
            "not found",
        ),
    ],
)
def test_bad_flags_get_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_run_records_routing(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "mixture"}\n')
    routing = tmp_path / "routing.jsonl"
    out = str(tmp_path / "out.jsonl")
    code = main(["run", "--prompts", str(prompts), "--output", out, "--max-new-tokens", "3",
                 "--record-routing", str(routing), "--hardware", "t4"])  # fmt: skip
    assert code == 0
    trace = RoutingTrace.load(routing)
    assert {key[0] for key in trace.counts} == {0, 1, 2}  # prefill and two decode steps
    assert all(
        sum(n for _e, n in c.counts) == 2 * 2 for (step, _l, _m), c in trace.counts.items() if step > 0
    )


def test_run_auto_runs_the_best_simulated_scheduler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "mixture"}\n{"id": "c", "prompt": "x"}\n'
    )
    out = tmp_path / "out.jsonl"
    argv = ["run", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "3", "--scheduler",
            "auto", "--hardware", "t4"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    chosen = re.search(r"auto: running (\S+) \(N=(\d+)", text)
    assert chosen is not None and chosen.group(1) in available() and int(chosen.group(2)) <= 3
    assert "flowmoe run — " in text and chosen.group(1) in text.split("flowmoe run — ")[1]
    assert len(out.read_text().splitlines()) == 3


def test_job_workload_and_no_runnable_scheduler() -> None:
    work = job_workload([4, 8, 16], gen=5)
    assert (work.prompt.minimum, work.prompt.maximum, work.gen_len) == (4, 16, 5)
    assert work.prompt.mean == pytest.approx(28 / 3) and work.prompt.spread > 0
    refused = Simulation(setup(policy=evolve(POLICY, gpu_memory=1000))).run("eager")
    with pytest.raises(ConfigError, match="no scheduler can run"):
        choice([refused])


def test_a_cache_split_by_layer_is_counted_where_each_layer_lives() -> None:
    """Klotski homes its first kv_gpu_share of the layers' caches on the GPU: the GPU check counts
    those layers and the host check the rest (a real run allocates them so)."""
    spec = preset("mixtral-8x7b", layers=4)
    base = Setup(spec, hardware("klotski-env1"), workload("fixed:512:4"), Policy(8, 2), decode_samples=1)
    simulation = {}
    for share in (0.0, 0.5):
        klotski = KlotskiOptions(hot_experts=2, group_size=2)
        policy = Policy(8, 2, weights_gpu_share=0.0, kv_gpu_share=share, options=(klotski,))
        simulation[share] = Simulation(evolve(base, policy=policy))
    batch = simulation[0.0].batch()
    whole = batch.total_slots * spec.kv_bytes_per_token
    split = simulation[0.5].scheduler("klotski")
    assert kv_bytes(split, batch, on_gpu=True) == whole // 2
    assert kv_bytes(split, batch, on_gpu=False) == whole // 2
    assert kv_bytes(simulation[0.0].scheduler("klotski"), batch, on_gpu=True) == 0
