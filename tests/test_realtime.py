"""The real-clock simulation: the real host stack on the real clock, device actions replaced by waits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import NodeFailed
from flowmoe.core.executor import Executor
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import workload
from flowmoe.devices.realclock import RealClockWorker, burn
from flowmoe.runtime.device_weights import DeviceWeights, NotResident
from flowmoe.study.realtime import meta_model, realtime_run
from flowmoe.study.simulate import Setup, Simulation
from tests.schedule_fixtures import TINY_CONFIG

SPEC = ModelSpec.from_hf(TINY_CONFIG)
POLICY = Policy(2, 2, weights_gpu_share=0.0, kv_gpu_share=1.0)


def simulation(policy: Policy = POLICY) -> Simulation:
    return Simulation(Setup(SPEC, hardware("t4"), workload("fixed:6:4"), policy))


def test_gpu_nodes_queue_like_a_stream_and_host_nodes_wait_for_their_producers() -> None:
    """GPU nodes are enqueued after their action (the executor hears at once) and occupy their lane
    for their cost, behind the lane and their producers; a cpu.compute consumer starts only once its
    GPU producer's device time has ended, then holds its thread for its own cost."""
    ran: list[int] = []
    copies = [TaskNode(i, Op.PAGE_COPY, Lane.GPU_H2D, layer=0, mb=0) for i in range(3)]
    ffn = TaskNode(3, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0, deps=(2,))
    host = TaskNode(4, Op.CPU_ATTN, Lane.CPU_COMPUTE, layer=0, mb=0, deps=(3,))
    cost = {0: 0.002, 1: 0.004, 2: 0.006, 3: 0.001, 4: 0.003}
    worker = RealClockWorker(lambda node: cost[node.id])

    async def run() -> list:
        executor = Executor(dict.fromkeys(Lane, worker))
        for node in [*copies, ffn, host]:
            executor.submit(node, lambda i=node.id: ran.append(i))
        await executor.drain()
        worker.synchronize()
        return executor.spans

    try:
        spans = {s.node.id: s for s in asyncio.run(run())}
    finally:
        worker.close()
    assert ran[:3] == [0, 1, 2] and set(ran) == set(cost)
    for i, span in spans.items():
        assert span.end - span.start >= cost[i] - 1e-9  # absolute: a clock near 3e4 s keeps ~1e-11 s
    assert all(spans[i].end <= spans[i + 1].start for i in range(2))  # one lane, in emission order
    assert spans[3].start >= spans[2].end and spans[4].start >= spans[3].end
    assert set(worker.host_seconds()) == {"gpu.h2d", "gpu.compute", "cpu.compute"}


def test_an_action_that_raises_fails_the_run_naming_the_node() -> None:
    worker = RealClockWorker(lambda node: 0.0)

    def boom() -> None:
        raise NotResident("expert 3 of layer 0 is not resident on the GPU")

    async def run() -> None:
        executor = Executor(dict.fromkeys(Lane, worker))
        executor.submit(TaskNode(0, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0, expert=3), boom)
        await executor.drain()

    try:
        with pytest.raises(NodeFailed, match="expert 3 of layer 0"):
            asyncio.run(run())
    finally:
        worker.close()


def test_the_model_is_not_counted_as_the_lanes_host_time() -> None:
    """Working out a node's modelled duration and launch charge is the real clock's own work, which a
    GPU run never does: the lane's host seconds leave it out (a model that burns 30 ms of CPU per
    node, lanes that do microseconds of host work)."""

    def slow(seconds: float) -> Callable[[TaskNode], float]:
        def model(node: TaskNode) -> float:
            burn(0.03)
            return seconds

        return model

    worker = RealClockWorker(slow(1e-4), host=slow(0.0))
    nodes = [
        TaskNode(0, Op.GATE, Lane.GPU_COMPUTE, layer=0, mb=0),
        TaskNode(1, Op.CPU_ATTN, Lane.CPU_COMPUTE),
    ]

    async def run() -> None:
        executor = Executor(dict.fromkeys(Lane, worker))
        for node in nodes:
            executor.submit(node)
        await executor.drain()

    try:
        asyncio.run(run())
    finally:
        worker.close()
    host = worker.host_seconds()
    assert set(host) == {"gpu.compute", "cpu.compute"}
    assert all(seconds < 0.03 for seconds in host.values()), host


def test_meta_model_has_real_shapes_and_no_storage() -> None:
    model = meta_model(SPEC)
    expert = model.weights.layers[1].experts[0]
    assert all(t.device.type == "meta" for t in expert.tensors())
    assert expert.nbytes == SPEC.expert_bytes


@pytest.mark.parametrize("name", ["cgopipe", "klotski", "lru-cache", "fiddler", "flexgen"])
def test_realtime_runs_the_simulated_steps_with_the_real_bookkeeping(name: str) -> None:
    sim = simulation()
    run = realtime_run(sim, name)
    assert run.steps == len(sim.steps)
    virtual = sim.run(name).simulated_seconds
    assert run.makespan_seconds == pytest.approx(virtual)
    # every node waits at least its modelled time, in the same lane order: never faster than the model
    assert run.realtime_makespan_seconds >= run.makespan_seconds * (1 - 1e-9)
    assert set(run.host_seconds) >= {"main", "gpu.compute"}
    assert len(run.trace.steps) == run.steps and all(w.host_seconds for w in run.trace.steps)
    counters = {c.name for c in run.trace.counters}
    assert {"gpu weight bytes", "gpu experts resident"} <= counters  # the runtime's own sampling ran
    if name == "cgopipe":  # experts paged in and out: the residency bookkeeping moved
        resident = {c.value for c in run.trace.counters if c.name == "gpu experts resident"}
        assert len(resident) > 1


def test_a_plan_whose_copies_do_not_land_fails_as_in_a_real_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert copies that record nothing: the first GPU expert FFN looks its weights up and finds
    them missing, as the real runtime's action would."""
    load = DeviceWeights.load

    def dense_only(
        self: DeviceWeights, layer: int, expert: int, part: int = -1, parts: int = 1, pages: int = 1
    ) -> None:
        if expert < 0:
            load(self, layer, expert, part, parts, pages)

    monkeypatch.setattr(DeviceWeights, "load", dense_only)
    with pytest.raises(NodeFailed, match="not resident"):
        realtime_run(simulation(), "cgopipe")


def test_simulate_realtime_json_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    trace = tmp_path / "rt.json"
    code = main(["simulate", "--model", str(tmp_path), "--workload", "fixed:6:4", "--scheduler", "cgopipe",
                 "--batch-size", "4", "--micro-batches", "2", "--realtime", "--json",
                 "--trace", str(trace)])  # fmt: skip
    assert code == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["realtime_makespan_seconds"] >= result["makespan_seconds"] > 0
    assert result["realtime_ratio"] == pytest.approx(
        result["realtime_makespan_seconds"] / result["makespan_seconds"]
    )
    assert "main" in result["host_seconds"] and result["host_seconds_per_step"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    steps = next(e for e in events if e.get("name") == "flowmoe_steps")["args"]["steps"]
    assert len(steps) == result["realtime_steps"] and all(s["host_us"] > 0 for s in steps)
