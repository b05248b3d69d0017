"""MoE-Lightning's staging copies on their own host lane, sharing the host's DRAM with the CPU attention
(cpu.stage, devices/sim.py); tensor parallelism as MoE-Lightning's S6-S9 run it: the all-reduce after
the MoE combine, hidden states and activations on every GPU."""

from __future__ import annotations

import asyncio

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Executor, Span
from flowmoe.core.hardware import HardwareSpec, hardware
from flowmoe.core.memory import activation_bytes
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.policy_search import memory_use, search
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory
from flowmoe.core.workloads import workload
from flowmoe.devices.sim import SimWorker, run_virtual
from flowmoe.schedulers.shared_options import PagedOptions
from flowmoe.study.reproduce import paper_numbers as P
from flowmoe.study.simulate import simulate
from tests.test_sched_pipelines import MIXTRAL, decode_step, scheduler, spans_of, uniform_trace

S7 = hardware("moe-lightning-s7")
MB = MicroBatchShape.from_lengths(0, [1] * 64, [2048] * 64)


def _run(nodes: list[TaskNode], cost: RooflineCost) -> dict[Op, Span]:
    async def go() -> list[Span]:
        executor = Executor(dict.fromkeys(Lane, SimWorker(cost)), clock=asyncio.get_running_loop().time)
        for node in nodes:
            executor.submit(node, None)
        await executor.drain()
        return executor.spans

    return {span.node.op: span for span in run_virtual(go())}


def _pair(hw: HardwareSpec) -> tuple[RooflineCost, TaskNode, TaskNode]:
    f = NodeFactory(MIXTRAL)
    attention = f.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, 0, MB)
    stage = f.node(Op.W_STAGE, Lane.CPU_STAGE, 1, expert=0)
    return RooflineCost(hw, MIXTRAL), attention, stage


def test_staging_and_attention_overlapping_share_the_hosts_dram() -> None:
    """Both alone draw more than half the DRAM: together each runs at its share, so the first to end
    takes its cost x (total draw / bandwidth) and the other finishes alone."""
    cost, attention, stage = _pair(S7)
    band, a_draw, s_draw = cost.host_memory_bandwidth, cost.host_draw(attention), cost.host_draw(stage)
    assert a_draw + s_draw > band and max(a_draw, s_draw) <= band
    spans = _run([attention, stage], cost)
    rate = band / (a_draw + s_draw)
    first, second = sorted((cost(attention), cost(stage)))
    assert spans[Op.CPU_ATTN].start == spans[Op.W_STAGE].start == 0.0
    ends = sorted(s.end for s in spans.values())
    assert ends[0] == pytest.approx(first / rate)
    assert ends[1] == pytest.approx(first / rate + second - first)
    moved = attention.bytes + stage.bytes
    assert moved / ends[1] <= band * (1 + 1e-9)  # never more than the DRAM sustains
    assert ends[1] < cost(attention) + cost(stage)  # but faster than one lane after the other


def test_host_lanes_under_the_dram_bandwidth_take_their_own_cost() -> None:
    """Cores that stream little (a per-core cap far under the DRAM) leave room for both at once."""
    cost, attention, stage = _pair(evolve(S7, cpu_cores=1))
    assert cost.host_draw(attention) + cost.host_draw(stage) <= cost.host_memory_bandwidth
    spans = _run([attention, stage], cost)
    assert spans[Op.CPU_ATTN].end == pytest.approx(cost(attention))
    assert spans[Op.W_STAGE].end == pytest.approx(cost(stage))


def test_cgopipe_stages_on_its_own_lane_beside_cpu_attention_within_the_dram_bandwidth() -> None:
    """The signature: with pageable weights every W_STAGE runs on cpu.stage, overlapping the CPU attention
    (the artifact's copy thread beside its attention thread), waits for its pinned slot's previous pages to
    leave for the GPU, and the host lanes together never stream more than the host's DRAM sustains."""
    pages = (PagedOptions(page_bytes=2**30),)
    policy = Policy(64, 4, attention_on="cpu", weights_gpu_share=0.25, options=pages)
    spec = MIXTRAL
    step = decode_step(4, 64, 2048)
    cost = RooflineCost(S7, spec)
    sched = scheduler("cgopipe", spec, policy, cost=cost, weights_pinned=False)
    spans = simulate(sched, [step], uniform_trace(spec, [step]), cost)
    stages, attends = spans_of(spans, Op.W_STAGE), spans_of(spans, Op.CPU_ATTN)
    assert stages and all(s.node.lane is Lane.CPU_STAGE for s in stages)
    assert any(s.start < a.end and a.start < s.end for s in stages for a in attends)
    ids = {s.node.id: s for s in spans}
    for s in stages:
        if s.node.layer >= 2:  # its slot's previous pages: the same chunk one layer back
            (sent,) = [ids[d] for d in s.node.deps]
            assert sent.node.op is Op.PAGE_COPY and sent.node.layer == s.node.layer - 1
            assert sent.end <= s.start + 1e-12
    host = sorted((s.start, s.end) for s in spans if s.node.lane.device == "cpu")
    busy, reach = 0.0, 0.0  # the time any host lane runs
    for start, end in host:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    moved = sum(s.node.bytes for s in spans if s.node.lane.device == "cpu")
    assert moved <= cost.host_memory_bandwidth * busy * (1 + 1e-9)


def test_tensor_parallel_combine_ends_in_an_all_reduce() -> None:
    """Megatron-style TP: the MoE block's row-parallel outputs are summed across GPUs after the combine,
    as after the O projection; one GPU has none."""
    spec = preset("mixtral-8x22b", layers=2)
    mb = MicroBatchShape.from_lengths(0, [1] * 64, [512] * 64)
    combine = NodeFactory(spec).node(Op.COMBINE, Lane.GPU_COMPUTE, 0, mb)
    assert combine.rows == 64
    four, one = RooflineCost(S7, spec), RooflineCost(hardware("t4"), spec)
    assert four.all_reduce_seconds(64) > 0 and one.all_reduce_seconds(64) == 0
    assert four(combine) >= four.all_reduce_seconds(64) + four.dispatch_seconds(Op.COMBINE)


def test_tensor_parallel_planner_holds_the_hidden_states_on_every_gpu() -> None:
    """TP splits weights and KV across the GPUs but replicates the hidden states and activations: the
    planner counts those once per GPU (as the MoE-Lightning artifact's planner, tp_size times)."""
    spec, policy = preset("mixtral-8x22b"), Policy(64, 8, "cpu", "gpu", weights_gpu_share=0.0)
    one, four = memory_use(spec, policy, 418, 128), memory_use(spec, policy, 418, 128, gpus=4)
    replicated = 512 * 418 * spec.hidden * spec.dtype_bytes + activation_bytes(spec, 64 * 418, 64)
    assert four[0] - one[0] == 3 * replicated and four[1] == one[1]
    best = search(spec, S7, workload("fixed:418:128").with_gen_len(128), max_batch=1024).best
    assert best.gpu_bytes == memory_use(spec, best.policy, best.prompt, best.gen, gpus=4)[0]


def test_scaling_figures_at_gen_128_fall_in_the_ranges_the_paper_quotes() -> None:
    """§5.3's 2.77-3.38x (S7 / S6) and 2.1-2.8x (S9 / S8) hold the ratios of the gen-128 figures."""
    at = P.ML_SCALING_GEN128
    for (small, large), (low, high) in P.ML_SCALING.items():
        assert low <= at[large] / at[small] <= high + 0.005
