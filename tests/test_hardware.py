"""Hardware presets and the sustained cost model: every sustained figure sourced, one unit
convention, GEMM efficiency by rows and dtype, pinned vs pageable copies, launch and sync costs,
host-memory refusal, and tensor parallelism as split work plus all-reduces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError, MemoryBudgetError
from flowmoe.core.hardware import GB, MULTI_GPU, PRESETS, SUSTAINED, GiB, hardware, to_json
from flowmoe.core.hrm import Phase, layer_times
from flowmoe.core.memory import host_need
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, Residency
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study.simulate import Setup, Simulation
from tests.schedule_fixtures import TINY_CONFIG

MIXTRAL = preset("mixtral-8x7b")
PAPER_MACHINES = {"t4", "l4", "2xt4", "4xt4", "klotski-env1", "klotski-env2", "fiddler-env1", "fiddler-env2",
                  "collab-4090", "pregated-a100"}  # fmt: skip
TODAY = {"t4", "l4", "a10g", "a5000", "a6000", "a40", "l40s", "a100-40", "a100-80", "h100", "h200", "rtx3090",
         "rtx4090", "rtx5090"}  # fmt: skip


def test_every_sustained_figure_has_a_source() -> None:
    assert set(PRESETS) >= PAPER_MACHINES | TODAY
    for name, spec in PRESETS.items():
        assert spec.name == name and spec.source, name
        needed = SUSTAINED + (MULTI_GPU if spec.gpus > 1 else ())
        missing = [f for f in needed if len(spec.source_of(f)) < 20]
        assert not missing, f"{name}: no source for {missing}"
        assert set(dict(spec.sources)) <= set(SUSTAINED + MULTI_GPU), name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_units_are_bytes_and_bytes_per_second(name: str) -> None:
    """Capacities in bytes (GiB-sized), bandwidths in bytes/s (GB/s-sized), shares in (0, 1]."""
    s = PRESETS[name]
    assert 8 * GiB <= s.gpu_memory / s.gpus <= 200 * GiB and 64 * GiB <= s.cpu_memory <= 4096 * GiB
    assert 100 * GB <= s.gpu_bandwidth <= 10_000 * GB and 20 * GB <= s.cpu_bandwidth <= 1000 * GB
    assert s.link_peak is not None and GB <= s.h2d_bandwidth <= s.link_peak <= 64 * GB
    assert s.pageable_h2d < s.h2d_bandwidth and s.pageable_d2h < s.d2h_bandwidth
    assert 1e12 <= s.gpu_flops <= 2e15 and 1e11 <= s.cpu_flops < s.gpu_flops
    for share in (s.gpu_memory_efficiency, s.cpu_gemm_efficiency, s.cpu_attention_efficiency,
                  s.cpu_compute_efficiency, *(e for _, e in s.gemm_efficiency)):  # fmt: skip
        assert 0 < share <= 1
    assert 0 < s.gpu_launch < 1e-3 and 0 < s.sync_latency < 1e-3 and 0 < s.copy_latency < 1e-3


def _expert(tokens: int, spec: object = MIXTRAL) -> object:
    mb = MicroBatchShape(0, tokens, tokens, tokens, tokens)
    return NodeFactory(spec).node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, mb, expert=0, tokens=tokens)


@pytest.mark.parametrize("name", ["t4", "l4", "a100-80", "h100", "rtx4090"])
def test_gemm_at_one_row_is_slower_per_flop_than_at_512(name: str) -> None:
    cost = RooflineCost(PRESETS[name], MIXTRAL)
    one, many = _expert(1), _expert(512)
    assert one.rows == 1 and many.rows == 512
    assert cost(one) / one.flops > 10 * cost(many) / many.flops
    hw = PRESETS[name]
    assert hw.gemm_share(1) < hw.gemm_share(16) < hw.gemm_share(512) == hw.gemm_share(4096)


def test_gemm_rows_pay_for_the_tile_and_fp32_runs_at_its_own_peak() -> None:
    """Below the 64-row tile the compute-bound time stays that of a full tile; fp32 GEMMs run at
    the fp32 (non-tensor) peak."""
    hw = evolve(PRESETS["a100-80"], gpu_bandwidth=1e18)  # compute bound at any row count
    cost = RooflineCost(hw, MIXTRAL)
    t8, t64 = (cost.compute_seconds("gpu", 2e12 * r / 64, 1.0, rows=r) for r in (8, 64))
    assert t8 == pytest.approx(t64)  # the same weights: eight rows take as long as a 64-row tile
    fp32 = RooflineCost(hw, MIXTRAL.with_dtype("float32"))
    ratio = fp32.compute_seconds("gpu", 2e12, 1.0, rows=512) / cost.compute_seconds("gpu", 2e12, 1.0, 512)
    assert ratio == pytest.approx(hw.gpu_flops / hw.gpu_fp32_flops)


def test_pageable_copies_are_slower_than_pinned() -> None:
    factory = NodeFactory(MIXTRAL)
    for name in ("t4", "rtx4090", "h100"):
        cost = RooflineCost(PRESETS[name], MIXTRAL)
        pinned = factory.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=0)
        pageable = factory.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=0, pageable=True)
        assert pageable.bytes == pinned.bytes and cost(pageable) > 2 * cost(pinned)
        store = factory.node(Op.KV_STORE, Lane.GPU_D2H, 0, MicroBatchShape(0, 8, 8, 800, 8), pageable=True)
        assert cost(store) > cost(evolve(store, pageable=False))


def test_launch_and_sync_costs() -> None:
    hw = PRESETS["t4"]
    cost = RooflineCost(hw, MIXTRAL)
    gate = NodeFactory(MIXTRAL).node(Op.GATE, Lane.GPU_COMPUTE, 0, MicroBatchShape(0, 1, 1, 1, 1))
    assert cost(gate) > hw.gpu_launch
    assert cost(evolve(gate, sync=True)) == pytest.approx(cost(gate) + hw.sync_latency)


def test_host_memory_refusal_and_disk_tier() -> None:
    small = evolve(PRESETS["t4"], cpu_memory=64 * GiB)
    need = host_need(MIXTRAL, Residency.dense_only(MIXTRAL), kv_on_host=GiB)
    assert need.weights > 80 * GiB and need.kv_cache == GiB
    with pytest.raises(MemoryBudgetError, match=r"needs .* of host memory, over the 64.00 GiB of t4") as err:
        need.check(small, "cgopipe")
    assert "\n" not in str(err.value) and "no disk tier" in str(err.value)
    assert need.refusal(small, "cgopipe", disk_tier=True) is None  # the schedule spills to disk
    assert need.refusal(evolve(small, disk_bandwidth=0.0), "x", disk_tier=True) is not None
    assert need.refusal(PRESETS["t4"], "cgopipe") is None  # 192 GiB holds Mixtral-8x7B


def test_simulation_refuses_a_model_the_host_cannot_hold() -> None:
    from flowmoe.core.spec import ModelSpec

    spec = ModelSpec.from_hf(TINY_CONFIG)
    hw = evolve(PRESETS["t4"], cpu_memory=spec.total_bytes // 2)
    setup = Setup(spec, hw, workload("fixed:8:2"), Policy(2, 1, weights_gpu_share=0.0), RoutingModel(seed=1))
    result = Simulation(setup).run("cgopipe")
    assert result.error is not None and "of host memory" in result.error
    assert Simulation(evolve(setup, hardware=PRESETS["t4"])).run("cgopipe").error is None


def test_tensor_parallel_halves_per_gpu_work_and_adds_all_reduces() -> None:
    one, two = PRESETS["t4"], PRESETS["2xt4"]
    assert two.gpus == 2 and two.gpu_memory == 2 * one.gpu_memory and two.gpu_flops == one.gpu_flops
    c1, c2 = RooflineCost(one, MIXTRAL), RooflineCost(two, MIXTRAL)
    expert = _expert(64)
    assert c2(expert) - two.gpu_launch == pytest.approx((c1(expert) - one.gpu_launch) / 2)
    mb = MicroBatchShape(0, 64, 64, 64, 64)
    post = NodeFactory(MIXTRAL).node(Op.POST_ATTN, Lane.GPU_COMPUTE, 0, mb)
    reduce = c2.all_reduce_seconds(64)
    assert reduce == pytest.approx(
        two.interconnect_latency + 64 * MIXTRAL.hidden * 2 / two.interconnect_bandwidth  # 2 (g-1)/g = 1
    )
    assert c2(post) == pytest.approx(two.gpu_launch + (c1(post) - one.gpu_launch) / 2 + reduce)
    copy = NodeFactory(MIXTRAL).node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=0)
    assert c2(copy) - two.copy_latency == pytest.approx((c1(copy) - one.copy_latency) / 2)  # a link per GPU
    with pytest.raises(ConfigError, match="tensor parallel"):
        RooflineCost(two)
    policy = Policy(64, 4, "cpu", "gpu", weights_gpu_share=0.0, kv_gpu_share=0.0)
    phase = Phase(256, 64, 1, 512)
    gpu1, gpu2 = layer_times(MIXTRAL, one, phase, policy).gpu, layer_times(MIXTRAL, two, phase, policy).gpu
    assert gpu1 / 2 < gpu2 < gpu1  # half the work plus the all-reduces (the HRM prices as the simulator)


def test_profiles_carry_sources_gpus_and_the_gemm_table(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(to_json(PRESETS["2xt4"])))
    assert hardware(str(path)) == PRESETS["2xt4"]
    bad = (({"gpus": 0}, "gpus"), ({"gemm_efficiency": [[1, -1]]}, "gemm_efficiency"),
           ({"sources": ["x"]}, "sources"), ({"interconnect_bandwidth": 0.0}, "interconnect"))  # fmt: skip
    for change, message in bad:
        path.write_text(json.dumps({**to_json(PRESETS["2xt4"]), **change}))
        with pytest.raises(ConfigError, match=message):
            hardware(str(path))
    assert math.isclose(PRESETS["t4"].gemm_share(math.inf), 21.24 / 65)
