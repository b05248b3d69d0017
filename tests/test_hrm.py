"""The hierarchical roofline: turning points and attainable performance on hand-computed cases,
layer times, the balance point, and the policy search under memory limits."""

from __future__ import annotations

import pytest
from attrs import evolve

from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import GiB, HardwareSpec, hardware
from flowmoe.core.hrm import (
    Hierarchy,
    OpPoint,
    Phase,
    Roof,
    balance_point,
    experts_hit,
    layer_ops,
    layer_times,
)
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.policy_search import CPU_USABLE, GPU_USABLE, memory_use, search
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import workload
from tests.schedule_fixtures import TINY_CONFIG

# GPU 100 TFLOP/s over 1 TB/s, CPU 1 TFLOP/s over 100 GB/s, a 10 GB/s link.
HW = HardwareSpec("hand", gpu_flops=100e12, gpu_bandwidth=1e12, gpu_memory=16 * GiB, cpu_flops=1e12,
                  cpu_bandwidth=100e9, cpu_memory=64 * GiB, h2d_bandwidth=10e9, d2h_bandwidth=10e9,
                  gpu_launch=0.0, cpu_launch=0.0, copy_latency=0.0)  # fmt: skip


def test_turning_points_by_hand() -> None:
    levels = Hierarchy.from_hardware(HW)
    assert levels.gpu.ridge == pytest.approx(100.0)  # 100e12 / 1e12
    assert levels.cpu.ridge == pytest.approx(10.0)  # 1e12 / 100e9
    assert levels.p1 == pytest.approx(100.0)  # CPU peak meets the link roof: 1e12 / 10e9
    assert levels.p2(50e12) == pytest.approx(5000.0)  # a 50 TFLOP/s kernel stops being link bound at 5000


def test_roofs_are_the_sustained_figures_the_simulator_prices_with() -> None:
    """Presets: a large GEMM's share of the tensor peak, the streaming share of memory bandwidth, the
    CPU's sustained flop/s and GEMM bandwidth, the pinned link; tensor parallel GPUs add up."""
    t4, two = hardware("t4"), hardware("2xt4")
    levels = Hierarchy.from_hardware(t4)
    assert levels.gpu.peak == pytest.approx(t4.gpu_flops * t4.gemm_share(4096)) != t4.gpu_flops
    assert levels.gpu.bandwidth == pytest.approx(t4.gpu_bandwidth * t4.gpu_memory_efficiency)
    assert levels.cpu.bandwidth == pytest.approx(t4.cpu_bandwidth * t4.cpu_gemm_efficiency)
    assert levels.link == t4.h2d_bandwidth
    pair = Hierarchy.from_hardware(two)
    assert (pair.gpu.peak, pair.link) == pytest.approx((2 * levels.gpu.peak, 2 * levels.link))


def test_attainable_is_the_lowest_roof() -> None:
    levels = Hierarchy.from_hardware(HW)
    # on the GPU: min(100e12, 1e12 * 10, 10e9 * 50) = 0.5 TFLOP/s, bound by the link
    assert levels.attainable(OpPoint("x", "gpu", 1e12, 1e11, 2e10)) == pytest.approx(0.5e12)
    # data already on the GPU: min(100e12, 1e12 * 10) = 10 TFLOP/s
    assert levels.attainable(OpPoint("x", "gpu", 1e12, 1e11)) == pytest.approx(10e12)
    # on the CPU at intensity 5 (below its ridge of 10): 100e9 * 5
    assert levels.attainable(OpPoint("x", "cpu", 5e11, 1e11)) == pytest.approx(0.5e12)
    assert Roof("r", 4.0, 2.0).attainable(1.0) == 2.0 and Roof("r", 4.0, 2.0).attainable(3.0) == 4.0


@pytest.mark.parametrize(
    ("intensity", "cpu_wins"), [(50.0, True), (99.0, True), (101.0, False), (1000.0, False)]
)
def test_p1_decides_cpu_or_move(intensity: float, cpu_wins: bool) -> None:
    """Data in CPU memory, read once: below P1 = 100 the CPU computes it faster than the link moves it."""
    flops = intensity * 1e9
    assert Hierarchy.from_hardware(HW).better_on_cpu(OpPoint("x", "gpu", flops, 1e9, 1e9)) is cpu_wins


def test_streamed_weights_take_the_link_time_by_hand() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)  # 4 experts of 3 * 32 * 48 float32 params
    policy = Policy(micro_batch_size=2, attention_on="gpu", weights_gpu_share=0.25)
    times = layer_times(spec, HW, Phase(2, 2, 1, 8), policy)
    assert times.h2d == pytest.approx(0.75 * 4 * 3 * 32 * 48 * 4 / 10e9)
    assert times.d2h == 0.0 and times.cpu == 0.0
    resident = layer_times(spec, HW, Phase(2, 2, 1, 8), evolve(policy, weights_gpu_share=1.0))
    assert resident.h2d == 0.0 and resident.gpu == pytest.approx(times.gpu)


def test_cpu_attention_moves_qkv_down_and_output_up() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)  # 4 heads x 8 = 32 q, 2 kv heads x 8 = 16 kv
    times = layer_times(spec, HW, Phase(4, 4, 1, 8), Policy(4, 1, "cpu", "gpu", weights_gpu_share=1.0))
    assert times.d2h == pytest.approx(4 * (32 + 2 * 16) * 4 / 10e9)
    assert times.h2d == pytest.approx(4 * 32 * 4 / 10e9)
    assert times.cpu > 0


def test_layer_ops_count_what_the_scheduler_nodes_count() -> None:
    """The HRM's matmuls and attention carry the flops and bytes of the nodes the simulator prices."""
    spec = ModelSpec.from_hf(TINY_CONFIG)
    mb = MicroBatchShape.from_lengths(0, [1, 1, 1], [7, 7, 7])
    ops = {op.name: op for op in layer_ops(spec, Phase(3, 3, 1, 8), Policy(3, 1, weights_gpu_share=1.0))}
    factory = NodeFactory(spec)
    for name, op in (("pre-attention", Op.PRE_ATTN), ("post-attention", Op.POST_ATTN), ("router", Op.GATE),
                     ("attention", Op.GPU_ATTN)):  # fmt: skip
        node = factory.node(op, Lane.GPU_COMPUTE, 0, mb)
        assert (ops[name].flops, ops[name].mem_bytes) == (node.flops, node.bytes), name


def test_experts_hit() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)  # 4 experts, top-2
    assert experts_hit(spec, 1) == pytest.approx(2.0)
    assert experts_hit(spec, 2) == pytest.approx(4 * (1 - 0.25))
    assert experts_hit(spec, 1000) == pytest.approx(4.0)


def test_balance_point_is_where_the_link_stops_bounding() -> None:
    spec, hw = preset("mixtral-8x7b"), hardware("t4")
    policy = Policy(micro_batch_size=64, attention_on="cpu", weights_gpu_share=0.0)
    n = balance_point(spec, hw, policy, 100)
    assert layer_times(spec, hw, Phase(n, 64, 1, 100), policy).bound != "CPU->GPU link"
    assert layer_times(spec, hw, Phase(n - 64, 64, 1, 100), policy).bound == "CPU->GPU link"
    resident = evolve(policy, weights_gpu_share=1.0)
    assert balance_point(spec, hw, resident, 100) == 64  # nothing streamed: never link bound


def test_search_fits_the_memory_and_prefers_resident_weights() -> None:
    spec, work = preset("mixtral-8x7b"), workload("mtbench").with_gen_len(32)
    hw = hardware("t4")
    result = search(spec, hw, work, max_batch=2048)
    best = result.best
    assert best.gpu_bytes <= GPU_USABLE * hw.gpu_memory and best.cpu_bytes <= CPU_USABLE * hw.cpu_memory
    assert (best.gpu_bytes, best.cpu_bytes) == memory_use(spec, best.policy, best.prompt, best.gen)
    assert best.policy.batch_size <= 2048 and best.policy.ffn_on == "gpu"
    assert result.per_placement[0] == best
    big = search(spec, evolve(hw, gpu_memory=512 * GiB), work, max_batch=2048).best
    assert big.policy.weights_gpu_share == 1.0 and big.throughput > best.throughput
    fixed = search(spec, hw, work, attention=("gpu",), ffn=("gpu",), max_batch=2048)
    assert {(c.policy.attention_on, c.policy.ffn_on) for c in fixed.per_placement} == {("gpu", "gpu")}


def test_search_reports_when_nothing_fits() -> None:
    with pytest.raises(ConfigError, match="no policy fits"):
        search(preset("mixtral-8x7b"), evolve(hardware("t4"), gpu_memory=GiB), workload("mtbench"))
