"""The real clock charges a CUDA run's launches to the thread that launches (issue 29, item 4)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from attrs import evolve

from flowmoe.core.executor import Executor, Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.devices.realclock import RealClockWorker
from flowmoe.study.realtime import (
    H200_OPS,
    NO_LAUNCH,
    LaunchCosts,
    cross_lane_waits,
    ops_per_node,
    other_seconds_per_node,
    realtime_run,
)
from tests.test_realtime import simulation

ROOT = Path(__file__).resolve().parent.parent
COPY = TaskNode(0, Op.PAGE_COPY, Lane.GPU_H2D, layer=0, mb=0)
FFN = TaskNode(1, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0, deps=(0,))
ATTN = TaskNode(2, Op.GPU_ATTN, Lane.GPU_COMPUTE, layer=0, mb=0, deps=(1,))
HOST = TaskNode(3, Op.CPU_ATTN, Lane.CPU_COMPUTE, layer=0, mb=0, deps=(2,))
NODES = (COPY, FFN, ATTN, HOST)


def run_nodes(worker: RealClockWorker, nodes: tuple[TaskNode, ...] = NODES) -> dict[int, Span]:
    """`nodes` through an executor on `worker` (every lane), the worker closed after -> spans by id."""

    async def run() -> list[Span]:
        executor = Executor(dict.fromkeys(Lane, worker))
        for node in nodes:
            executor.submit(node, None)
        await executor.drain()
        worker.synchronize()
        return executor.spans

    try:
        return {s.node.id: s for s in asyncio.run(run())}
    finally:
        worker.close()


def test_launch_costs_per_operation_and_per_node() -> None:
    costs = LaunchCosts(op_seconds=1e-5, node_seconds=1e-4, ops={Op.EXPERT_FFN: 6, Op.PAGE_COPY: 7})
    assert costs(FFN) == pytest.approx(1e-4 + 6e-5)  # a compute node: its action plus its operations
    assert costs(COPY) == pytest.approx(7e-5)  # a page copy's bookkeeping runs for real: its operations only
    assert costs(ATTN) == pytest.approx(1e-4)  # a kind without a count: the node's own cost
    assert costs(HOST) == 0.0  # a host node's modelled duration holds its thread already
    assert NO_LAUNCH(FFN) == 0.0 and LaunchCosts()(FFN) > 0  # the H200 run's costs by default


def test_more_operations_per_node_cost_more_host_time() -> None:
    """The regression benchmark's premise: cutting operations cuts the modelled charge."""
    nodes = [s.node for s in realtime_run(simulation(), "cgopipe", launch=NO_LAUNCH).trace.spans]
    base = LaunchCosts()
    grouped = evolve(base, ops={**H200_OPS, Op.EXPERT_FFN: 2 * H200_OPS[Op.EXPERT_FFN]})
    assert any(n.op == Op.EXPERT_FFN for n in nodes)
    assert grouped.charge(nodes) > base.charge(nodes) > 0


def test_the_charge_lands_on_the_launching_lane_before_the_device_time() -> None:
    costs = LaunchCosts(op_seconds=1e-3, node_seconds=5e-3, ops={Op.EXPERT_FFN: 4, Op.PAGE_COPY: 2})
    worker = RealClockWorker(lambda node: 1e-3, host=costs)
    spans = run_nodes(worker)
    charged = worker.charged_seconds()
    assert charged == pytest.approx({"gpu.compute": costs(FFN) + costs(ATTN), "gpu.h2d": costs(COPY)})
    host = worker.host_seconds()
    for lane, seconds in charged.items():  # spent as the lane thread's CPU time
        assert host[lane] >= seconds
    # the kernels cannot start before they are launched: each GPU span begins after its charge
    for node in (COPY, FFN, ATTN):
        assert spans[node.id].start - spans[node.id].queued >= costs(node)
    assert spans[HOST.id].start >= spans[ATTN.id].end


def test_realtime_run_charges_its_host() -> None:
    sim = simulation()
    costs = LaunchCosts(op_seconds=2e-6, node_seconds=2e-5)
    run = realtime_run(sim, "cgopipe", launch=costs)
    charge = costs.charge([s.node for s in run.trace.spans])
    assert charge > 0
    gpu_lanes = sum(v for k, v in run.host_seconds.items() if k.startswith("gpu."))
    assert gpu_lanes >= charge  # the lane threads' CPU time holds the charge


def test_each_cross_lane_producer_charges_one_wait_on_the_consumers_lane() -> None:
    """A stream.wait_event per producer on another GPU lane; none for a producer on the same lane or
    on a host lane (ordered by the executor)."""
    costs = LaunchCosts(op_seconds=0.0, node_seconds=0.0, ops={}, node_gap_seconds=1e-5, wait_seconds=1e-3,
                        evict_seconds=0.0, readback_seconds=0.0)  # fmt: skip
    copies = [TaskNode(10 + i, Op.PAGE_COPY, Lane.GPU_H2D, layer=0, mb=0) for i in range(3)]
    host = TaskNode(20, Op.CPU_ATTN, Lane.CPU_COMPUTE, layer=0, mb=0)
    ffn = TaskNode(21, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0, deps=(10, 11, 12, 20, 22))
    same = TaskNode(22, Op.GPU_ATTN, Lane.GPU_COMPUTE, layer=0, mb=0)
    lanes = {n.id: n.lane for n in (*copies, host, ffn, same)}
    assert cross_lane_waits(ffn, lanes) == 3
    assert costs(ffn, 3) == pytest.approx(1e-5 + 3e-3)
    assert costs.charge([*copies, host, same, ffn]) == pytest.approx(5 * 1e-5 + 3e-3)  # 5 GPU nodes, 3 waits
    worker = RealClockWorker(lambda node: 0.0, host=lambda node: costs(node, cross_lane_waits(node, lanes)))
    worker.start(same, None, lambda *a: None)
    worker.start(ffn, None, lambda *a: None)
    worker.close()
    assert worker.charged_seconds() == {"gpu.compute": pytest.approx(2e-5 + 3e-3)}  # the consumer's lane


def test_evicts_and_read_backs_are_charged_where_they_run() -> None:
    """An EVICT pays its record_stream on its lane; each routing read-back burns on the thread that
    answers it (the event loop's), and the run's charge counts one per gate."""
    sim = simulation()
    none = realtime_run(sim, "cgopipe", launch=NO_LAUNCH)
    costs = LaunchCosts(op_seconds=0.0, node_seconds=0.0, ops={}, node_gap_seconds=0.0, wait_seconds=0.0,
                        evict_seconds=2e-4, readback_seconds=3e-3)  # fmt: skip
    run = realtime_run(sim, "cgopipe", launch=costs)
    nodes = [s.node for s in run.trace.spans]
    evicts, gates = sum(n.op == Op.EVICT for n in nodes), sum(n.op == Op.GATE for n in nodes)
    assert evicts > 0 and gates > 0
    assert costs.charge(nodes) == pytest.approx(2e-4 * evicts + 3e-3 * gates)
    assert run.host_seconds["main"] - none.host_seconds["main"] >= 0.5 * 3e-3 * gates


def test_the_default_operation_counts_are_bench_step_counts() -> None:
    """H200_OPS is bench/step_counts.json's cgopipe row at the H200 setting (regenerate it after
    re-running bench/step_counts.py)."""
    data = json.loads((ROOT / "bench/step_counts.json").read_text())
    row = next(r for r in data["rows"] if r["scheduler"] == "cgopipe" and r["setting"].startswith("H200"))
    counted = ops_per_node(row)
    assert set(counted) == set(H200_OPS)
    assert all(H200_OPS[op] == pytest.approx(counted[op], abs=0.005) for op in counted), counted


def test_a_per_thread_record_charges_the_threads_outside_the_stack() -> None:
    """A GPU run's per-thread record: its threads that are neither the loop's nor the lanes' (and
    those that exited inside a step) per GPU node, counted in the host time on no thread."""
    record = {"thread_cpu_s_per_step": {"main": 0.3, "flowmoe-cuda-gpu.compute": 0.2,
                                        "native:cuda-EvtHandlr": 0.05, "native:python": 0.1},
              "process_cpu_s_per_step": 0.7}  # fmt: skip
    per_node = other_seconds_per_node(record, 500)
    assert per_node == pytest.approx((0.05 + 0.1 + 0.05) / 500)
    sim = simulation()
    costs = evolve(NO_LAUNCH, other_seconds=per_node)
    run = realtime_run(sim, "cgopipe", launch=costs)
    gpu_nodes = sum(s.node.lane.on_gpu for s in run.trace.spans)
    assert gpu_nodes > 0
    assert run.host_seconds["other threads"] == pytest.approx(per_node * gpu_nodes)
    assert "other threads" not in realtime_run(sim, "cgopipe", launch=NO_LAUNCH).host_seconds


def test_a_rows_file_without_a_per_thread_record_is_one_line_and_exit_2(tmp_path: Path) -> None:
    rows = tmp_path / "gpu.jsonl"  # the H200 run's rows, before the per-thread records
    rows.write_text((ROOT / "bench/gpu-runs/2026-11-27-h200-after-item3/gpu.jsonl").read_text())
    command = [sys.executable, "bench/realtime_overhead.py", "--h200", "--threads", str(rows),
               "--out", str(tmp_path / "out.json")]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"{rows}: no cgopipe t4 row with a per-thread record (thread_cpu): not a bench/gpu.py --out file "
        "of this version"
    ]
