"""InlineWorker: runs each node's action on the event-loop thread itself.

For no-op and bookkeeping nodes, where a thread hop would cost more than the
work; the executor-overhead benchmark measures the executor with it."""

from __future__ import annotations

import asyncio
import time

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import TaskNode


class InlineWorker:
    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            if action is not None:
                action()
        except BaseException as exc:  # reported through the executor, which names the node
            error = exc
        asyncio.get_running_loop().call_soon(finish, start, time.perf_counter(), error)

    def close(self) -> None:
        pass
