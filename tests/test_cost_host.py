"""The cost model's host-side effects: the host issues every kernel of a node (a GPU node takes at
least its kernels x the dispatch time), a CPU node pays each op's dispatch, and CPU streaming work
(attention, GEMMs) is capped by what the cores it runs on stream."""

from __future__ import annotations

import json

import pytest
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.core.cost import KERNELS, RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import GB, PRESETS, from_json, to_json
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory

MIXTRAL = preset("mixtral-8x7b")
T4 = PRESETS["t4"]


def _node(op: Op, lane: Lane, n_bytes: int, flops: int = 0, rows: int = 0) -> TaskNode:
    return TaskNode(0, op, lane, bytes=n_bytes, flops=flops, rows=rows)


def test_a_small_gpu_node_takes_its_kernels_dispatch() -> None:
    cost = RooflineCost(T4, MIXTRAL)
    tiny = _node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 1000, 1000, rows=1)
    dispatch = KERNELS[Op.EXPERT_FFN] * T4.host_dispatch
    assert T4.host_dispatch > 0 and KERNELS[Op.EXPERT_FFN] > KERNELS[Op.GATE] > 1
    assert cost(tiny) == pytest.approx(T4.gpu_launch + dispatch)
    gate = evolve(tiny, op=Op.GATE)
    assert cost(gate) == pytest.approx(T4.gpu_launch + KERNELS[Op.GATE] * T4.host_dispatch)  # fewer kernels
    no_host = RooflineCost(evolve(T4, host_dispatch=0.0), MIXTRAL)
    assert no_host(tiny) < T4.gpu_launch + 1e-6  # without it, the same node is its launch and a few bytes


def test_a_large_gpu_node_hides_its_dispatch() -> None:
    """The host issues the next kernels while the GPU runs a long one: only the roofline counts."""
    cost = RooflineCost(T4, MIXTRAL)
    expert = NodeFactory(MIXTRAL).node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, MicroBatchShape(0, 64, 64, 64, 64))
    work = cost.compute_seconds("gpu", expert.flops, expert.bytes, rows=expert.rows)
    assert work > 10 * cost.dispatch_seconds(Op.EXPERT_FFN)
    assert cost(expert) == pytest.approx(T4.gpu_launch + work)


def test_a_cpu_node_adds_each_ops_dispatch() -> None:
    cost = RooflineCost(T4, MIXTRAL)
    attention = _node(Op.CPU_ATTN, Lane.CPU_COMPUTE, 0)
    expert = _node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, 0)
    assert cost(attention) == pytest.approx(T4.cpu_launch + KERNELS[Op.CPU_ATTN] * T4.cpu_op_dispatch)
    assert cost(expert) - cost(attention) == pytest.approx(
        (KERNELS[Op.EXPERT_FFN] - KERNELS[Op.CPU_ATTN]) * T4.cpu_op_dispatch
    )
    big = _node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, int(1e9))  # the CPU runs its ops in turn: they add up
    assert cost(big) == pytest.approx(cost(expert) + cost.compute_seconds("cpu", 0, 1e9))


def test_a_measured_overhead_replaces_launch_and_dispatch() -> None:
    measured = evolve(T4, op_overhead=(("gpu.compute/gate", 3e-6), ("cpu.compute/cpu_attn", 4e-6)))
    cost = RooflineCost(measured, MIXTRAL)
    assert cost(_node(Op.GATE, Lane.GPU_COMPUTE, 1)) == pytest.approx(3e-6, rel=1e-3)
    assert cost(_node(Op.CPU_ATTN, Lane.CPU_COMPUTE, 0)) == pytest.approx(4e-6)


def test_a_host_with_more_cores_attends_faster() -> None:
    """CPU attention reads the KV cache: with few cores, what they stream bounds it, not DRAM."""
    mb = MicroBatchShape(0, 64, 64, 64 * 1024, 64 * 1024)
    attention = NodeFactory(MIXTRAL).node(Op.CPU_ATTN, Lane.CPU_COMPUTE, 0, mb)
    times = [RooflineCost(evolve(T4, cpu_cores=cores), MIXTRAL)(attention) for cores in (1, 2, 12)]
    assert times[0] > times[1] == times[2]  # 2 Haswell cores stream what S1's DRAM gives attention
    one = T4.cpu_core_bandwidth
    assert times[0] == pytest.approx(
        T4.cpu_launch + KERNELS[Op.CPU_ATTN] * T4.cpu_op_dispatch + attention.bytes / one
    )
    assert times[2] == pytest.approx(
        times[0] - attention.bytes / one + attention.bytes / (T4.cpu_bandwidth * T4.cpu_attention_efficiency)
    )


def test_a_runs_cpu_threads_use_that_many_cores() -> None:
    """`threads` (a policy's cpu_threads) limits the cores CPU work streams and computes on."""
    l4 = PRESETS["l4"]
    expert = NodeFactory(MIXTRAL).node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, 0, MicroBatchShape(0, 4, 4, 4, 4))
    times = [RooflineCost(l4, MIXTRAL, threads)(expert) for threads in (1, 2, 4, None)]
    assert times[0] > times[1] > times[2] > times[3]
    assert RooflineCost(l4, MIXTRAL, 64)(expert) == pytest.approx(times[3])  # more threads than cores
    flops = 1e12  # compute-bound work scales with the share of cores
    full, one = RooflineCost(l4, MIXTRAL), RooflineCost(l4, MIXTRAL, 1)
    assert one.compute_seconds("cpu", flops, 1) == pytest.approx(
        l4.cpu_cores * full.compute_seconds("cpu", flops, 1)
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 128), st.integers(1, 128), st.floats(1e6, 1e10))
def test_more_cores_are_never_slower(a: int, b: int, n_bytes: float) -> None:
    few, many = sorted((a, b))
    for op in (Op.CPU_ATTN, Op.EXPERT_FFN):
        node = _node(op, Lane.CPU_COMPUTE, int(n_bytes), int(n_bytes))
        assert RooflineCost(evolve(T4, cpu_cores=many))(node) <= RooflineCost(evolve(T4, cpu_cores=few))(node)


def test_presets_name_their_cores_and_what_one_streams() -> None:
    for name, spec in PRESETS.items():
        assert 1 <= spec.cpu_cores <= 256, name
        assert 5 * GB <= spec.cpu_core_bandwidth <= 60 * GB, name
        assert 1e-6 <= spec.host_dispatch <= 1e-4 and 0 < spec.cpu_op_dispatch <= 1e-4, name
        assert spec.sync_latency > spec.host_dispatch, name  # a sync empties the GPU's queue: refill


def test_a_profile_keeps_the_host_figures() -> None:
    data = json.loads(json.dumps(to_json(T4)))
    back = from_json(data, "t4.json")
    assert (back.cpu_cores, back.host_dispatch, back.cpu_core_bandwidth) == (12, T4.host_dispatch, 19.9 * GB)
    with pytest.raises(ConfigError, match="'cpu_cores' must be a whole number"):
        from_json({**data, "cpu_cores": 2.5}, "t4.json")
