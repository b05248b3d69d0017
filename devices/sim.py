"""SimWorker and the virtual clock: the same executor, nodes 'take' what a cost function says.

`VirtualClockLoop` is an asyncio loop whose clock jumps straight to the next
timer instead of sleeping, so a node finishing at t + cost is a timer, and a
whole paper-size decode step simulates in milliseconds of wall time.

Host memory is shared: with a cost model that says how fast each host-lane node streams DRAM
(`HostMemoryShare`: RooflineCost), nodes of cpu.compute and cpu.stage that run at once progress
at their shares of the host's DRAM bandwidth. While the draws of the running nodes add up to more
than the DRAM sustains, each runs at draw x bandwidth / total (every node slowed by the same
factor, its share proportional to what it streams alone); a node's end is re-timed whenever one
starts or ends. Nodes that fit under the bandwidth together take their own cost, as on any lane.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from attrs import define

from flowmoe.core.cost import HostMemoryShare
from flowmoe.core.executor import Action, Finish
from flowmoe.core.plan import TaskNode

T = TypeVar("T")
Cost = Callable[[TaskNode], float]


@define
class _Draw:
    """A running node that streams host DRAM: `left` seconds of its own cost still to run."""

    start: float
    left: float
    draw: float  # bytes/s it streams alone
    finish: Finish
    timer: asyncio.TimerHandle | None = None


class SimWorker:
    """Ignores actions; a node occupies its lane for `cost(node)` virtual seconds, stretched while
    host-lane nodes that run together draw more than the host's DRAM sustains (`HostMemoryShare`)."""

    def __init__(self, cost: Cost) -> None:
        self._cost = cost
        self._share = cost if isinstance(cost, HostMemoryShare) else None
        self._running: list[_Draw] = []
        self._since = 0.0  # when the running draws' `left` was last brought up to date

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        seconds = max(0.0, self._cost(node))
        draw = self._share.host_draw(node) if self._share is not None else 0.0
        if draw > 0 and seconds > 0:
            self._settle(now)
            self._running.append(_Draw(now, seconds, draw, finish))
            self._retime(loop)
            return
        # The span ends when the loop's clock says so (it may land a rounding error short of
        # now + cost), so that what starts next never appears to start before this ends.
        loop.call_at(now + seconds, lambda: finish(now, loop.time(), None))

    def _rate(self) -> float:
        """How fast every running draw progresses: 1, or the DRAM's bandwidth over their total."""
        assert self._share is not None
        total = sum(d.draw for d in self._running)
        return min(1.0, self._share.host_memory_bandwidth / total) if total > 0 else 1.0

    def _settle(self, now: float) -> None:
        """Charge the running draws the time since the last change, at the rate they had."""
        if self._running:
            rate = self._rate()
            for d in self._running:
                d.left = max(0.0, d.left - (now - self._since) * rate)
        self._since = now

    def _retime(self, loop: asyncio.AbstractEventLoop) -> None:
        rate, now = self._rate(), loop.time()
        for d in self._running:
            if d.timer is not None:
                d.timer.cancel()
            d.timer = loop.call_at(now + d.left / rate, self._done, d, loop)

    def _done(self, d: _Draw, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self._settle(now)
        self._running.remove(d)
        self._retime(loop)
        d.finish(d.start, now, None)

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
