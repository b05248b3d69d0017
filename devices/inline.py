"""InlineWorker: runs each node's action on the event-loop thread itself.

Without CUDA every lane computes on the same cores, so overlapping lanes on threads of their own
buys nothing but OpenMP teams competing for those cores and a thread hop per node (two per routing
answer, each waiting for the OS to schedule the woken thread on a busy machine). The runtime then
runs every node here: one loop callback per node, the step's ops on the thread that runs the
engine, in inference mode and with the thread plan's intra-op threads (flowmoe/core/threads.py),
as a plain eager step runs them. The executor-overhead benchmark measures the executor alone
with it.

A node's action runs in a loop callback of its own, never inside the executor's hand-off: an
interrupt (Ctrl-C) raised in the middle of an action first reports the node failed, so no lane is
left busy, then goes on out of the loop as any Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import TaskNode
from flowmoe.devices.threadpool import run_action, set_intra_op


class InlineWorker:
    def __init__(self, threads: int | None = None, profile_ranges: bool = True) -> None:
        """`threads`: torch intra-op threads, set on the loop's thread before its first node
        (default: leave the thread's own); `profile_ranges` names each node in torch's profiler
        while one records."""
        self._threads = threads
        self._thread = 0  # the thread `threads` was set on
        self._ranges = profile_ranges
        self._inference = torch.inference_mode()  # entered around each action (reusable, not reentrant)

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        asyncio.get_running_loop().call_soon(self._run, node, action, finish)

    def _run(self, node: TaskNode, action: Action, finish: Finish) -> None:
        if self._threads is not None and self._thread != threading.get_ident():
            set_intra_op(self._threads)
            self._thread = threading.get_ident()
        start = time.perf_counter()
        try:
            if action is not None:
                with self._inference:
                    run_action(node, action, self._ranges)
        except Exception as exc:  # reported through the executor, which names the node
            finish(start, time.perf_counter(), exc)
        except BaseException as exc:  # an interrupt: the node failed, and the interrupt goes on
            finish(start, time.perf_counter(), exc)
            raise
        else:
            finish(start, time.perf_counter(), None)

    def close(self) -> None:
        pass
