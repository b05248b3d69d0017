"""A CPU expert of a few rows: it streams its weights for longer than one row does (`cpu_gemm`), as
flowmoe calibrate measured on the dev VM and Fiddler reports; one row, attention, the GPU and a
calibrated profile's own roofline are priced as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowmoe.core.cost import RooflineCost
from flowmoe.core.cpu_gemm import ROWS_FACTOR, rows_factor
from flowmoe.core.hardware import PRESETS, from_json
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.presets import preset

MIXTRAL = preset("mixtral-8x7b")
HOST = PRESETS["fiddler-env1"]
PROFILE = Path(__file__).parents[1] / "bench" / "sim_accuracy_profile.json"


def _expert(rows: int, lane: Lane = Lane.CPU_COMPUTE, op: Op = Op.EXPERT_FFN) -> TaskNode:
    params = 3 * MIXTRAL.hidden * MIXTRAL.moe.intermediate
    return TaskNode(0, op, lane, bytes=params * 2, flops=2 * rows * params, rows=rows)


def test_the_factor_is_the_calibrated_roofline_read_as_time_per_row() -> None:
    profile = json.loads(PROFILE.read_text())
    flops = [f for _, f in sorted(profile["cpu_roofline"])][:5]  # 1, 2, 4, 8, 16 rows
    for (rows, factor), measured in zip(ROWS_FACTOR, flops, strict=True):
        assert factor == pytest.approx(rows * flops[0] / measured, rel=1e-4)
    assert rows_factor(1) == 1.0 and rows_factor(0) == 1.0
    assert rows_factor(2) == pytest.approx(1.85, abs=0.01)
    assert rows_factor(8) == pytest.approx(3.18, abs=0.01)
    assert rows_factor(64) == rows_factor(16)  # flat past the last point: the flop term binds there
    factors = [rows_factor(r) for r in (1, 2, 3, 4, 6, 8, 12, 16)]
    assert factors == sorted(factors)


def test_a_cpu_expert_of_eight_rows_streams_three_times_longer_than_one_row() -> None:
    cost = RooflineCost(HOST, MIXTRAL, threads=16)
    one, eight = cost(_expert(1)), cost(_expert(8))
    fixed = cost.fixed(Lane.CPU_COMPUTE, Op.EXPERT_FFN)
    assert (eight - fixed) / (one - fixed) == pytest.approx(rows_factor(8), rel=1e-6)
    streaming = _expert(1).bytes / HOST.cpu_stream_bandwidth(HOST.cpu_gemm_efficiency, 16)
    assert one - fixed == pytest.approx(streaming)  # one row: the weights once, as before


def test_attention_the_gpu_and_a_calibrated_profile_keep_their_pricing() -> None:
    cost = RooflineCost(HOST, MIXTRAL, threads=16)
    gpu = cost.compute_seconds("gpu", 2 * 8 * 1e6, 2e6, rows=8)
    assert gpu == pytest.approx(RooflineCost(HOST, MIXTRAL).compute_seconds("gpu", 2 * 8 * 1e6, 2e6, rows=8))
    attention_1 = cost.compute_seconds("cpu", 1e6, 1e8, attention=True, rows=1)
    attention_8 = cost.compute_seconds("cpu", 1e6, 1e8, attention=True, rows=8)
    assert attention_1 == attention_8
    calibrated = RooflineCost(from_json(json.loads(PROFILE.read_text()), "profile"))
    node = _expert(8)
    intensity = node.flops / node.bytes
    curve = calibrated._curves["cpu"]
    assert curve is not None
    expected = node.flops / curve.attained(intensity)
    assert calibrated.compute_seconds("cpu", node.flops, node.bytes, rows=8) == pytest.approx(expected)
