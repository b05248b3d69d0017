"""ThreadPoolWorker: CPU work (and the GPU lanes on a machine without CUDA) on host threads.

Each lane gets one thread of its own, so its nodes run one at a time in
emission order while different lanes overlap; torch ops release the GIL. The
number of threads each torch op may use inside itself is configurable
(default: what the machine has, split over the compute lanes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import Lane, TaskNode

Hook = Callable[[TaskNode], None]


class ThreadPoolWorker:
    def __init__(
        self, threads: int | None = None, before: Hook | None = None, profile_ranges: bool = True
    ) -> None:
        """`threads`: torch intra-op threads; `before(node)` runs on the lane thread ahead of the
        node (the CUDA worker hooks its event waits there); `profile_ranges` names each node
        in torch's profiler."""
        if threads is not None:
            torch.set_num_threads(max(1, threads))
        self._before = before
        self._ranges = profile_ranges
        self._pools: dict[Lane, ThreadPoolExecutor] = {}

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        pool = self._pools.get(node.lane)
        if pool is None:
            pool = self._pools[node.lane] = ThreadPoolExecutor(1, thread_name_prefix=f"flowmoe-{node.lane}")
        pool.submit(self._run, node, action, finish)

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            if self._before is not None:
                self._before(node)
            start = time.perf_counter()
            if action is not None:
                if self._ranges:
                    with torch.profiler.record_function(node.label):
                        action()
                else:
                    action()
        except BaseException as exc:  # reported through the executor, which names the node
            error = exc
        end = time.perf_counter()
        finish(start, end, error)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
