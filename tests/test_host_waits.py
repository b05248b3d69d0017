"""How a CUDA run's host threads wait for the device, on the real clock and replayed on a simulated
timeline (issue 29 item 4): which waits the code makes, which of them CUDA spins through."""

from __future__ import annotations

import pytest

from flowmoe.core.executor import Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.devices.realclock import (
    DEVICE,
    EVENT,
    NOW,
    RUN4,
    STREAM,
    SYNCS_AT_8FCF0A3,
    DeviceWaits,
    RealClockWorker,
    WaitMode,
)
from flowmoe.study.realtime import LaunchCosts, realtime_run, replay_host, split_spins
from tests.test_realtime import simulation
from tests.test_realtime_launch import run_nodes as on_worker

COPY = TaskNode(0, Op.PAGE_COPY, Lane.GPU_H2D, layer=0, mb=0)
FFN = TaskNode(1, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0, deps=(0,))
ATTN = TaskNode(2, Op.GPU_ATTN, Lane.GPU_COMPUTE, layer=1, mb=0, deps=(1,))
GATE = TaskNode(3, Op.GATE, Lane.GPU_COMPUTE, layer=1, mb=0, deps=(2,))
NODES = (COPY, FFN, ATTN, GATE)
COSTS = {COPY.id: 0.05, FFN.id: 0.001, ATTN.id: 0.001, GATE.id: 0.001}  # seconds on the device
CHARGE = LaunchCosts(op_seconds=0.0, node_seconds=1e-3, ops={}, node_gap_seconds=0.0, wait_seconds=0.0,
                     evict_seconds=0.0, readback_seconds=0.0)  # fmt: skip
THEN = DeviceWaits(syncs=SYNCS_AT_8FCF0A3)  # the H200 run 4's code: a gate's bincount read its input back


def run_nodes(waits: DeviceWaits) -> tuple[dict[int, Span], RealClockWorker]:
    worker = RealClockWorker(lambda node: COSTS[node.id], waits=waits)
    return on_worker(worker, NODES), worker


def test_the_wait_modes_say_what_spins() -> None:
    """CUDA's default spins through every wait; blocking events (a6ee63a) sleep on the pooled
    events only, not on a stream or device synchronize; BlockingSync sleeps through all."""
    waits = {("gpu.compute", STREAM): 1.0, ("main", EVENT): 2.0, ("main", DEVICE): 4.0}
    assert RUN4.spun(waits) == {"gpu.compute": 1.0, "main": 6.0}
    assert NOW.spun(waits) == {"gpu.compute": 1.0, "main": 4.0}
    assert WaitMode(spin=False).spun(waits) == {}


def test_a_gate_holds_its_lane_until_the_device_reaches_it() -> None:
    """At 8fcf0a3 a gate's read-backs (torch.bincount's) waited on its stream for everything before
    it, here a 50 ms copy, and the lane's next launch came after; today's gate counts without a
    read-back, and the lane runs ahead."""
    spans, worker = run_nodes(THEN)
    waited = worker.wait_seconds()
    assert waited[("gpu.compute", STREAM)] == pytest.approx(0.05, abs=0.01)
    assert spans[GATE.id].start >= spans[ATTN.id].end
    assert worker.host_seconds()["gpu.compute"] < 0.01  # the wait is not host work
    _, free = run_nodes(DeviceWaits())
    assert ("gpu.compute", STREAM) not in free.wait_seconds()


def test_the_run_ahead_bound_waits_on_an_event_instead() -> None:
    """With run_ahead 1 the compute lane waits for its previous node's end (a pooled event) before the
    next launch, so the gate's read-back finds its stream drained: the wait is an event's, and it
    sleeps with blocking events."""
    _, worker = run_nodes(DeviceWaits(syncs=SYNCS_AT_8FCF0A3, run_ahead=1))
    waited = worker.wait_seconds()
    assert waited[("gpu.compute", EVENT)] == pytest.approx(0.05, abs=0.01)
    assert waited.get(("gpu.compute", STREAM), 0.0) < 0.005
    assert NOW.spun(waited).get("gpu.compute", 0.0) < 0.005 < RUN4.spun(waited)["gpu.compute"]


def test_the_replay_is_the_timeline_s_waits() -> None:
    """On a simulated timeline (a 50 ms copy, then an FFN, attention and a gate of 1 ms each), the
    compute lane launches in 1 ms each and its gate's read-back waits for the device to reach the
    gate (at 52 ms, launched at 3 ms: 49 ms on the stream); the driver's read-back waits the gate's
    1 ms; with run_ahead 1 the wait moves onto events (the attention's launch waits for the FFN's end,
    the gate's for the attention's) and each launch then holds the device: 55 ms."""
    at = {COPY.id: (0.0, 0.05), FFN.id: (0.05, 0.051), ATTN.id: (0.051, 0.052), GATE.id: (0.052, 0.053)}
    spans = [Span(n, *at[n.id]) for n in NODES]
    free = replay_host(spans, CHARGE, THEN)
    assert free.busy == pytest.approx({"gpu.h2d": 0.0, "gpu.compute": 3e-3})
    assert free.waits == pytest.approx({("gpu.compute", STREAM): 0.049, ("main", EVENT): 0.001})
    assert free.seconds == pytest.approx(0.053)
    bound = replay_host(spans, CHARGE, DeviceWaits(syncs=SYNCS_AT_8FCF0A3, run_ahead=1))
    assert bound.waits[("gpu.compute", EVENT)] == pytest.approx(0.051)  # 1 -> 51 ms, 52 -> 53 ms
    assert bound.waits[("gpu.compute", STREAM)] == pytest.approx(0.0)
    assert bound.seconds == pytest.approx(0.055)


def test_realtime_run_keeps_each_thread_s_spinning_apart() -> None:
    """Under 8fcf0a3's mode the real clock's host seconds carry every wait as spinning, apart from the
    threads' host work; under BlockingSync none; the host work is the same kind of figure in both."""
    sim = simulation()
    spun = realtime_run(sim, "cgopipe", mode=RUN4)
    work, waits = split_spins(spun.host_seconds)
    assert waits and all(seconds >= 0 for seconds in waits.values())
    assert set(work) >= {"main", "gpu.compute"}
    asleep = realtime_run(sim, "cgopipe", mode=WaitMode(spin=False))
    assert split_spins(asleep.host_seconds)[1] == {}
