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
from collections.abc import Callable

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import GPU_LANES, Lane, TaskNode
from flowmoe.devices.threadpool import LaneThreads

Cost = Callable[[TaskNode], float]
SPIN_SECONDS = 50e-6


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
    def __init__(self, cost: Cost, spin: float = SPIN_SECONDS, host: Cost | None = None) -> None:
        self._cost = cost
        self._host = host
        self._charged: dict[Lane, float] = {}  # lane -> modelled launch seconds charged (its thread only)
        self._spin = spin
        self._lanes = LaneThreads(self._serve, prefix="flowmoe-realclock")
        self._ends: dict[int, float] = {}  # node id -> end of its device time (this step's nodes)
        self._free: dict[Lane, float] = {}  # GPU lane -> end of its last enqueued node
        self._busy: dict[Lane, float] = {}  # lane -> host CPU seconds (written by that lane's thread only)
        self.sync_cpu_seconds = 0.0  # CPU the caller of sync / synchronize spent waiting (spinning)

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        self._lanes.put(node, action, finish)

    def _serve(self, node: TaskNode, action: Action, finish: Finish) -> None:
        (self._launch if node.lane in GPU_LANES else self._run)(node, action, finish)

    def _launch(self, node: TaskNode, action: Action, finish: Finish) -> None:
        """A GPU node: the action on the host, then the device time queued behind lane and producers."""
        cost, charge, error = self._model(node)
        cpu = time.thread_time()
        if error is None:
            cost, error = self._act(action, cost)
        if self._host is not None and error is None:
            self._charged[node.lane] = self._charged.get(node.lane, 0.0) + charge
            burn(charge)  # the launches, on this thread: the device time begins after them
        begin = max(time.perf_counter(), self._free.get(node.lane, 0.0), self._after(node))
        end = self._ends[node.id] = self._free[node.lane] = begin + cost
        finish(begin, end, error)  # enqueued; the executor's hand-off to released nodes runs here
        self._busy[node.lane] = self._busy.get(node.lane, 0.0) + time.thread_time() - cpu

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        """A host node: wait for its GPU producers, run the action, hold the thread for its cost."""
        cost, _, error = self._model(node)
        wait_until(self._after(node), self._spin)
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
        """Block the calling thread until node `node_id`'s device time has ended (a read-back)."""
        self._wait(self._ends.get(node_id, 0.0))

    def synchronize(self) -> None:
        """Block until every enqueued node has ended; a new step starts from an idle device."""
        self._wait(max(self._ends.values(), default=0.0))
        self._ends.clear()
        self._free.clear()

    def _wait(self, deadline: float) -> None:
        cpu = time.thread_time()
        wait_until(deadline, self._spin)
        self.sync_cpu_seconds += time.thread_time() - cpu

    def host_seconds(self) -> dict[str, float]:
        """CPU seconds each lane thread spent on host work (actions and the executor), waits excluded."""
        return {str(lane): seconds for lane, seconds in sorted(self._busy.items())}

    def charged_seconds(self) -> dict[str, float]:
        """The modelled launch seconds charged on each GPU lane's thread (`host`), exact: the CPU time
        spent on them is in `host_seconds`."""
        return {str(lane): seconds for lane, seconds in sorted(self._charged.items())}

    def close(self) -> None:
        self._lanes.close()
