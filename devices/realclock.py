"""RealClockWorker: the CUDA worker's timing on the real clock, with every device action replaced by
the cost model's duration.

Each lane has a thread of its own, handed its nodes as `CudaStreamWorker`'s are (`LaneThreads`: one
queue put per node). A GPU-lane node runs its host-side
action and is then *enqueued*: its device time starts when the action is done, its lane's previous
node has ended and every producer has ended (the stream's event waits), and lasts `cost(node)`;
the executor hears `finish` at once, so the lane's next node launches while this one "runs", as
a stream's launch thread runs ahead of the GPU. Host-side consumers wait for the device: a
cpu.compute or disk.read node first waits until its producers' device time has ended (the CUDA
worker's `wait_host`), then holds its thread for its cost; `sync(node)` is a routing read-back
(`.tolist()` on the gate's output) and `synchronize()` the step's device synchronize.

How the host waits for the device (`DeviceWaits`): a GPU node whose action reads the device back
(`syncs`: the LM head's logits copied to the host; at 8fcf0a3 also a gate's `torch.bincount`) holds
its lane thread, after its launches, until its stream's device time reaches it; `run_ahead` holds a
lane's thread before its k-th node of a step until its (k - run_ahead)-th has ended
(devices/cuda.py's bound); `sync`, `synchronize` and a host node's wait for its GPU producers are
the event and device waits above. Each wait's length comes from the simulated timeline, kept by
thread and by what it waits on (`wait_seconds`: a pooled event, a stream, the device), apart from
what the thread measurably spent; `WaitMode.spun` says which of them CUDA would spin through, as CPU
time of the waiting thread.

A GPU node's host-side launches (`host(node)`: the modelled CPU seconds a CUDA run's launch thread
spends dispatching the node's torch operations and kernel launches, e.g. `study.realtime.LaunchCosts`)
are charged on the lane's own thread, as CPU time, after its action and before its device time may
begin: the kernels cannot run before they are launched, so a schedule whose launches take longer than
its device work comes out host-bound. The modelled charge is counted apart (`charged_seconds`).

Waits sleep while far (releasing the GIL) and spin the last `spin` seconds, yielding the GIL at
every turn, because a sleep overshoots by the kernel's timer slack. Each lane thread's CPU time is
counted without its waits and without working out the model (`cost` and `host`, which a GPU run does
not compute), so what the host stack costs per lane is measured next to the wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from attrs import field, frozen

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import GPU_LANES, Lane, Op, TaskNode
from flowmoe.devices.cuda import BOUNDED_LANES
from flowmoe.devices.threadpool import LaneThreads

Cost = Callable[[TaskNode], float]
SPIN_SECONDS = 50e-6


# Stream synchronizations inside a GPU node's action. Now: the LM head copies its logits to the host
# with `non_blocking=False` (torch's `memcpy_and_sync`: a stream synchronize). At 8fcf0a3 (the H200 run 4)
# also a gate's (and pre-gate's) `torch.bincount`, which on CUDA reads its input's min (`.cpu()`) and max
# (`.item()`) back to the host to size its output (aten/src/ATen/native/cuda/SummaryOps.cu,
# `_bincount_cuda_template`), so the gate's launching thread waited until its stream had run everything
# before the gate; the gate now counts with `index_add_` (kernels/router.py `sort_by_expert`).
IN_ACTION_SYNCS: Mapping[Op, int] = {Op.LM_HEAD: 1}
SYNCS_AT_8FCF0A3: Mapping[Op, int] = {Op.GATE: 2, Op.PREGATE: 2, Op.LM_HEAD: 1}


EVENT, STREAM, DEVICE = "event", "stream", "device"  # what a host wait waits on
Waits = dict[tuple[str, str], float]  # (thread, what it waited on) -> seconds waited


@frozen
class DeviceWaits:
    """The host waits a CUDA run's code makes beyond the executor's order: `syncs`, the stream
    synchronizations inside a GPU node's action, by kind; `run_ahead`, the CUDA worker's bound on the
    launches of the lanes that read back (devices/cuda.py `BOUNDED_LANES`, FLOWMOE_CUDA_RUN_AHEAD;
    0: unbounded)."""

    syncs: Mapping[Op, int] = field(factory=lambda: dict(IN_ACTION_SYNCS))
    run_ahead: int = 0

    def bound(self, lane: Lane) -> int:
        """The nodes `lane` may launch ahead of its stream (0: unbounded)."""
        return self.run_ahead if lane in BOUNDED_LANES else 0


@frozen
class WaitMode:
    """How a host thread waits for the device (CUDA Runtime API, `cudaSetDeviceFlags`). `spin`: the
    context's scheduling spins: CUDA's default, `cudaDeviceScheduleAuto`, resolves to
    `cudaDeviceScheduleSpin` when the process has no more active CUDA contexts than the host has
    logical CPUs (any one-GPU host), so a stream or device synchronize, a blocking copy and a wait on
    an event made without `cudaEventBlockingSync` burn the waiting thread's CPU for as long as they
    wait; False: `cudaDeviceScheduleBlockingSync`, every wait sleeps. `blocking_events`: the CUDA
    worker's pooled events carry `cudaEventBlockingSync` (devices/cuda.py since a6ee63a; not at
    8fcf0a3): a wait on one (a routing's read-back, a CPU lane's GPU producer, the run-ahead bound)
    sleeps whatever `spin` says."""

    spin: bool = True
    blocking_events: bool = True

    def spins(self, waited_on: str) -> bool:
        return self.spin and not (waited_on == EVENT and self.blocking_events)

    def spun(self, waits: Waits) -> dict[str, float]:
        """Seconds each thread spends spinning, of the waits `waits` (`RealClockWorker.wait_seconds`)."""
        out: dict[str, float] = {}
        for (thread, waited_on), seconds in waits.items():
            if self.spins(waited_on):
                out[thread] = out.get(thread, 0.0) + seconds
        return out


RUN4 = WaitMode(spin=True, blocking_events=False)  # 8fcf0a3 as the H200 run 4 ran it
NOW = WaitMode(spin=True, blocking_events=True)  # the code as it is (a6ee63a's blocking events)


def wait_until(deadline: float, spin: float = SPIN_SECONDS) -> None:
    """Return at `deadline` (time.perf_counter): sleep while it is far, then spin."""
    remaining = deadline - time.perf_counter()
    if remaining > spin:
        time.sleep(remaining - spin)
    while time.perf_counter() < deadline:
        time.sleep(0)  # yields the GIL to the other lanes


def burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time (a launch's host work), yielding the GIL at every
    turn as torch does around a dispatch."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        time.sleep(0)


class RealClockWorker:
    def __init__(
        self,
        cost: Cost,
        spin: float = SPIN_SECONDS,
        host: Cost | None = None,
        waits: DeviceWaits | None = None,
    ) -> None:
        self._cost = cost
        self._host = host
        self._waits = DeviceWaits(syncs={}) if waits is None else waits
        self._charged: dict[Lane, float] = {}  # lane -> modelled launch seconds charged (its thread only)
        self._spin = spin
        self._lanes = LaneThreads(self._serve, prefix="flowmoe-realclock")
        self._ends: dict[int, float] = {}  # node id -> end of its device time (this step's nodes)
        self._free: dict[Lane, float] = {}  # GPU lane -> end of its last enqueued node
        self._busy: dict[Lane, float] = {}  # lane -> host CPU seconds (written by that lane's thread only)
        self._launched: dict[Lane, list[float]] = {}  # GPU lane -> device ends of this step's nodes, in order
        self._waited: Waits = {}  # (thread, what it waits on) -> seconds; "main": sync's caller
        self.sync_cpu_seconds = 0.0  # CPU the caller of sync / synchronize spent waiting

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        self._lanes.put(node, action, finish)

    def _serve(self, node: TaskNode, action: Action, finish: Finish) -> None:
        (self._launch if node.lane in GPU_LANES else self._run)(node, action, finish)

    def _launch(self, node: TaskNode, action: Action, finish: Finish) -> None:
        """A GPU node: the action on the host, then the device time queued behind lane and producers."""
        cost, charge, error = self._model(node)
        waits, lane = self._waits, node.lane
        ended, bound = self._launched.setdefault(lane, []), waits.bound(lane)
        if bound and len(ended) >= bound:  # the bound's wait on a pooled event
            self._hold(str(lane), ended[-bound], EVENT)
        cpu = time.thread_time()
        if error is None:
            cost, error = self._act(action, cost)
        if self._host is not None and error is None:
            self._charged[lane] = self._charged.get(lane, 0.0) + charge
            burn(charge)  # the launches, on this thread: the device time begins after them
        begin = max(time.perf_counter(), self._free.get(lane, 0.0), self._after(node))
        if error is None and waits.syncs.get(node.op):  # a read-back: the stream reaches the node first
            cpu += self._hold(str(lane), begin, STREAM)
        end = self._ends[node.id] = self._free[lane] = begin + cost
        ended.append(end)
        finish(begin, end, error)  # enqueued; the executor's hand-off to released nodes runs here
        self._busy[lane] = self._busy.get(lane, 0.0) + time.thread_time() - cpu

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        """A host node: wait for its GPU producers, run the action, hold the thread for its cost."""
        cost, _, error = self._model(node)
        self._hold(str(node.lane), self._after(node), EVENT)  # `wait_host`
        cpu = time.thread_time()
        start = time.perf_counter()
        if error is None:
            cost, error = self._act(action, cost)
        host = time.thread_time() - cpu
        wait_until(start + cost, self._spin)
        end = self._ends[node.id] = time.perf_counter()
        cpu = time.thread_time()
        finish(start, end, error)
        self._busy[node.lane] = self._busy.get(node.lane, 0.0) + host + time.thread_time() - cpu

    def _model(self, node: TaskNode) -> tuple[float, float, BaseException | None]:
        """The node's modelled device seconds and, on a GPU lane, its launches' charge (`host`), or
        the error (reported through the executor, which names the node): the model's work, not the
        host stack's, so worked out before the lane's CPU time is counted."""
        try:
            charge = max(0.0, self._host(node)) if self._host is not None and node.lane in GPU_LANES else 0.0
            return max(0.0, self._cost(node)), charge, None
        except BaseException as exc:
            return 0.0, 0.0, exc

    @staticmethod
    def _act(action: Action, cost: float) -> tuple[float, BaseException | None]:
        """Run the node's host-side action: `cost`, or the error and no duration."""
        try:
            if action is not None:
                action()
            return cost, None
        except BaseException as exc:
            return 0.0, exc

    def _after(self, node: TaskNode) -> float:
        return max((self._ends.get(dep, 0.0) for dep in node.deps), default=0.0)

    def sync(self, node_id: int) -> None:
        """Block the calling thread until node `node_id`'s device time has ended (a read-back: a wait
        on the node's pooled event)."""
        self._wait(self._ends.get(node_id, 0.0), EVENT)

    def synchronize(self) -> None:
        """Block until every enqueued node has ended (a device synchronize); a new step starts from an
        idle device."""
        self._wait(max(self._ends.values(), default=0.0), DEVICE)
        self._ends.clear()
        self._free.clear()
        self._launched.clear()

    def _wait(self, deadline: float, waited_on: str) -> None:
        self.sync_cpu_seconds += self._hold("main", deadline, waited_on)

    def _hold(self, thread: str, deadline: float, waited_on: str) -> float:
        """Wait until `deadline`, its length (from the timeline) kept as `thread`'s wait on
        `waited_on`. -> the CPU this thread measurably spent in the wait."""
        cpu, start = time.thread_time(), time.perf_counter()
        wait_until(deadline, self._spin)
        key = (thread, waited_on)
        self._waited[key] = self._waited.get(key, 0.0) + max(0.0, deadline - start)
        return time.thread_time() - cpu

    def host_seconds(self) -> dict[str, float]:
        """CPU seconds each lane thread spent on host work (actions and the executor), waits excluded."""
        return {str(lane): seconds for lane, seconds in sorted(self._busy.items())}

    def wait_seconds(self) -> Waits:
        """Seconds each thread (a lane's; "main": the caller of sync and synchronize) waited for the
        device, by what it waited on, from the timeline (not in `host_seconds`)."""
        return dict(sorted(self._waited.items()))

    def charged_seconds(self) -> dict[str, float]:
        """The modelled launch seconds charged on each GPU lane's thread (`host`), exact: the CPU time
        spent on them is in `host_seconds`."""
        return {str(lane): seconds for lane, seconds in sorted(self._charged.items())}

    def close(self) -> None:
        self._lanes.close()
