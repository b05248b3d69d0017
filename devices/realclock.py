"""RealClockWorker: a lane thread per lane; each node runs its host-side action, then holds its lane
until the cost model's duration has passed on the real clock.

The host work of a node (its action's bookkeeping, the executor's hand-off to
what it released) overlaps the node's modelled device time, as a kernel launch
overlaps the kernel: a node takes max(host work, cost) on its lane. Long waits
sleep (releasing the GIL); the last `spin` seconds are spun, yielding the GIL
at every turn, because a sleep overshoots by the kernel's timer slack.

Each lane thread's CPU time is counted, less the spinning, so what the host
stack costs per lane is measured next to the wall clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import Lane, TaskNode

Cost = Callable[[TaskNode], float]
SPIN_SECONDS = 50e-6


def wait_until(deadline: float, spin: float = SPIN_SECONDS) -> None:
    """Return at `deadline` (time.perf_counter): sleep while it is far, then spin."""
    remaining = deadline - time.perf_counter()
    if remaining > spin:
        time.sleep(remaining - spin)
    while time.perf_counter() < deadline:
        time.sleep(0)  # yields the GIL to the other lanes


class RealClockWorker:
    def __init__(self, cost: Cost, spin: float = SPIN_SECONDS) -> None:
        self._cost = cost
        self._spin = spin
        self._pools: dict[Lane, ThreadPoolExecutor] = {}
        self._busy: dict[Lane, float] = {}  # lane -> host CPU seconds (written by that lane's thread only)
        self._lock = threading.Lock()

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        pool = self._pools.get(node.lane)
        if pool is None:
            with self._lock:
                pool = self._pools.get(node.lane)
                if pool is None:
                    pool = ThreadPoolExecutor(1, thread_name_prefix=f"flowmoe-realclock-{node.lane}")
                    self._pools[node.lane] = pool
        pool.submit(self._run, node, action, finish)

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        cpu = time.thread_time()
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            if action is not None:
                action()
            cost = max(0.0, self._cost(node))
        except BaseException as exc:  # reported through the executor, which names the node
            error, cost = exc, 0.0
        host = time.thread_time() - cpu
        wait_until(start + cost, self._spin)
        end = time.perf_counter()
        cpu = time.thread_time()
        finish(start, end, error)  # the executor's hand-off to released nodes runs here: host work too
        self._busy[node.lane] = self._busy.get(node.lane, 0.0) + host + time.thread_time() - cpu

    def host_seconds(self) -> dict[str, float]:
        """CPU seconds each lane thread spent on host work (actions and the executor), waits excluded."""
        return {str(lane): seconds for lane, seconds in sorted(self._busy.items())}

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
