"""ThreadPoolWorker: CPU work (and the GPU lanes on a machine without CUDA) on host threads.

Each lane gets one thread of its own, so its nodes run one at a time in
emission order while different lanes overlap; torch ops release the GIL. Each
lane thread sets its own torch intra-op threads once, when it starts (the thread
plan's share, flowmoe/core/threads.py; 1 unless told): torch's setting holds per
calling thread, and a thread that never set it would take whatever another
thread set last.

`LaneThreads` is the hop itself: a queue and a thread per lane, nothing else
per node (no future, no work item), so handing a node to its lane costs one
queue put. Lane threads run in torch's inference mode (no autograd bookkeeping
on any op), set once per thread rather than once per node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from queue import SimpleQueue

import torch

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import Lane, TaskNode

Hook = Callable[[TaskNode], None]
Job = tuple[TaskNode, Action, Finish]


def set_intra_op(threads: int) -> None:
    """The calling thread's torch intra-op threads (its OpenMP team and MKL's), for good.

    torch sizes a thread's team from the process-wide value the first time that thread asks for
    it; asking first (get_num_threads) settles that, so a later set_num_threads on another thread
    cannot resize this one's team behind its back."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def run_action(node: TaskNode, action: Callable[[], object], ranges: bool = True) -> None:
    """`action()`, named for the node in torch's profiler while one records (`ranges`)."""
    if ranges and torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(node.label):
            action()
    else:
        action()


class LaneThreads:
    """One thread per lane running `serve(node, action, finish)` for each job put on that lane.

    `serve` must report through `finish` and not raise; should it raise anyway, the node is
    reported failed with that error, so the executor never waits on it forever."""

    def __init__(
        self,
        serve: Callable[[TaskNode, Action, Finish], None],
        prefix: str = "flowmoe",
        init: Callable[[Lane], None] | None = None,
        intra_op: int = 1,
    ) -> None:
        """`init(lane)` runs once on each lane's thread before its first job; `intra_op`: the torch
        threads each lane thread computes with (1: launch threads, which compute little)."""
        self._serve = serve
        self._prefix = prefix
        self._init = init
        self._intra_op = intra_op
        self._queues: dict[Lane, SimpleQueue[Job | None]] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def put(self, node: TaskNode, action: Action, finish: Finish) -> None:
        queue = self._queues.get(node.lane)
        if queue is None:
            queue = self._open(node.lane)
        queue.put((node, action, finish))

    def _open(self, lane: Lane) -> SimpleQueue[Job | None]:
        with self._lock:
            queue = self._queues.get(lane)
            if queue is None:
                queue = SimpleQueue()
                thread = threading.Thread(
                    target=self._loop, args=(lane, queue), name=f"{self._prefix}-{lane}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
                self._queues[lane] = queue
        return queue

    def _loop(self, lane: Lane, queue: SimpleQueue[Job | None]) -> None:
        serve, broken = self._serve, None
        set_intra_op(self._intra_op)
        if self._init is not None:
            try:
                self._init(lane)
            except BaseException as exc:  # every job of this lane then fails with it
                broken = exc
        with torch.inference_mode():
            while (job := queue.get()) is not None:
                try:
                    if broken is not None:
                        raise broken
                    serve(*job)
                except BaseException as exc:  # handed to the executor, which names the node
                    now = time.perf_counter()
                    job[2](now, now, exc)

    def close(self) -> None:
        """Finish what is queued, then stop the threads."""
        with self._lock:
            queues, self._queues = self._queues, {}
            threads, self._threads = self._threads, []
        for queue in queues.values():
            queue.put(None)
        for thread in threads:
            thread.join()


class ThreadPoolWorker:
    def __init__(
        self, threads: int | None = None, before: Hook | None = None, profile_ranges: bool = True
    ) -> None:
        """`threads`: torch intra-op threads of each lane thread (default: those of the thread that
        makes the worker); `before(node)` runs on the lane thread ahead of the node (the CUDA worker
        hooks its event waits there); `profile_ranges` names each node in torch's profiler while one
        records."""
        self._before = before
        self._ranges = profile_ranges
        self._lanes = LaneThreads(self._run, intra_op=threads or torch.get_num_threads())

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        self._lanes.put(node, action, finish)

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        error: BaseException | None = None
        start = time.perf_counter()
        try:
            if self._before is not None:
                self._before(node)
                start = time.perf_counter()
            if action is not None:
                run_action(node, action, self._ranges)
        except BaseException as exc:  # reported through the executor, which names the node
            error = exc
        finish(start, time.perf_counter(), error)

    def close(self) -> None:
        self._lanes.close()
