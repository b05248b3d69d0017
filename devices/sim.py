"""SimWorker and the virtual clock: the same executor, nodes 'take' what a cost function says.

`VirtualClockLoop` is an asyncio loop whose clock jumps straight to the next
timer instead of sleeping, so a node finishing at t + cost is a timer, and a
whole paper-size decode step simulates in milliseconds of wall time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import TaskNode

T = TypeVar("T")
Cost = Callable[[TaskNode], float]


class SimWorker:
    """Ignores actions; a node occupies its lane for `cost(node)` virtual seconds."""

    def __init__(self, cost: Cost) -> None:
        self._cost = cost

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        # The span ends when the loop's clock says so (it may land a rounding error short of
        # now + cost), so that what starts next never appears to start before this ends.
        loop.call_at(now + max(0.0, self._cost(node)), lambda: finish(now, loop.time(), None))

    def close(self) -> None:
        pass


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking and advances the virtual clock by the loop's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is not None and timeout > 0 and self.loop is not None:
            self.loop.advance(timeout)
            timeout = 0
        return super().select(timeout)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh virtual-clock loop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
