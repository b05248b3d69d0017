"""InlineWorker: runs each node's action on the event-loop thread itself.

Without CUDA every lane computes on the same cores, so overlapping lanes on threads of their own
buys nothing but OpenMP teams competing for those cores and a thread hop per node (two per routing
answer, each waiting for the OS to schedule the woken thread on a busy machine). The runtime then
runs every node here: the step's ops on the thread that runs the engine, in inference mode and
with the thread plan's intra-op threads (flowmoe/core/threads.py), as a plain eager step runs
them. The executor-overhead benchmark measures the executor alone with it.

Started nodes wait in a queue that one loop callback runs in order (entering inference mode once
for all of them): a node that a finished one releases joins the queue and runs in the same
callback, so a chain of nodes costs one loop iteration, not one each. Before the executor waits
for a node (the driver, for a gate whose routing it needs) it runs the queue itself
(`run_started`), so the chain up to that node runs on the spot and the wait returns without a
trip through the loop.

A node's action never runs inside the executor's hand-off (`start` only queues it): an interrupt
(Ctrl-C) raised in the middle of an action first reports that node failed, so no lane is left
busy, then goes on out of the loop as any Ctrl-C does; the nodes still queued behind it run in a
callback of their own, as they would have.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque

import torch

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import TaskNode
from flowmoe.core.threads import CoTenants
from flowmoe.devices.threadpool import Job, run_action, set_intra_op


class InlineWorker:
    def __init__(self, threads: int | None = None, profile_ranges: bool = True) -> None:
        """`threads`: torch intra-op threads, set on the loop's thread before its first node
        (default: leave the thread's own); `profile_ranges` names each node in torch's profiler
        while one records."""
        self._threads = threads
        self._thread = 0  # the thread `threads` was set on
        # a team of several threads keeps to the cores other processes leave free (core/threads.py)
        self._tenants = CoTenants(threads) if threads is not None and threads > 1 else None
        self._team = threads
        # queue runs by the team width they ran with: a run asked for several threads says how often
        # co-tenants left it fewer (bench/vs_llamacpp.py reports it beside its rows)
        self.team_runs: Counter[int] = Counter()
        self._ranges = profile_ranges
        self._inference = torch.inference_mode()  # entered around each run of the queue (not reentrant)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the queue belongs to
        self._queue: deque[Job] = deque()  # started nodes, in start order
        self._running = False  # `_run_queue` is running the queue

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        if self._running:  # released by a node of the queue now running: it runs next in turn
            self._queue.append((node, action, finish))
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new run: what a closed loop left queued is no node of it
            self._loop, self._queue, self._running = loop, deque(), False
        self._queue.append((node, action, finish))
        if len(self._queue) == 1:  # no callback is on its way to run it
            loop.call_soon(self._run_queue)

    def run_started(self) -> None:
        """Run the queue now, on this (the loop's) thread: the executor calls it before it waits
        for a node, so the driver's next routing answer costs no trip through the loop."""
        if self._queue and not self._running and self._loop is asyncio.get_running_loop():
            self._run_queue()

    def _run_queue(self) -> None:
        queue = self._queue
        if not queue:  # run_started ran it first
            return
        self._running = True
        try:
            if self._threads is not None and self._thread != threading.get_ident():
                self._thread = threading.get_ident()
                set_intra_op(self._threads)
                self._team = self._threads
            if self._tenants is not None:
                if self._tenants.width(time.monotonic()) != self._team:
                    self._team = self._tenants.team
                    torch.set_num_threads(self._team)  # this thread's team, the cores co-tenants leave
                self.team_runs[self._team] += 1
            ranges = self._ranges and torch.autograd.profiler._is_profiler_enabled  # once per queue run
            clock = time.perf_counter
            with self._inference:
                while queue:  # each node run here, not in a call of its own: one frame less a node
                    node, action, finish = queue.popleft()
                    start = clock()
                    try:
                        if ranges and action is not None:
                            run_action(node, action)
                        elif action is not None:
                            action()
                    except Exception as exc:  # reported through the executor, which names the node
                        finish(start, clock(), exc)
                    except BaseException as exc:  # an interrupt: the node failed, and the interrupt goes on
                        finish(start, clock(), exc)
                        raise
                    else:
                        finish(start, clock(), None)
        finally:
            self._running = False
            if queue:  # an interrupt left started nodes queued: they run in a callback of their own
                asyncio.get_running_loop().call_soon(self._run_queue)

    def close(self) -> None:
        pass
