"""The dataflow executor: one queue per lane, nodes start in emission order once their deps are done.

Nodes arrive as a stream (`submit`) while the run is in progress, because a
scheduler learns a layer's routing only after its gate ran. The executor is
callback driven: a worker is told to start a node and calls back when it has
finished (or, for a CUDA stream, when it is enqueued behind its producers'
events). Everything here runs on the asyncio loop thread; workers hop threads
themselves.

Failures never hang: a dependency that never arrives, a cycle, or lane order
and dependencies waiting on each other are reported with the nodes involved; the
first node that raises stops every lane from starting anything new and surfaces
as NodeFailed naming the node.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from attrs import frozen

from flowmoe.core.errors import NodeFailed, PlanError
from flowmoe.core.plan import Lane, TaskNode

Action = Callable[[], Any] | None
Finish = Callable[[float, float, BaseException | None], None]


@frozen(slots=True)
class Span:
    """What ran where and when (seconds on the run's clock); `queued` is when it was submitted."""

    node: TaskNode
    start: float
    end: float
    queued: float = 0.0


class Worker(Protocol):
    """Runs nodes of the lanes it serves; calls `finish(start, end, error)` on the loop thread."""

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None: ...

    def close(self) -> None: ...


class Executor:
    def __init__(
        self,
        workers: Mapping[Lane, Worker],
        on_span: Callable[[Span], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`clock` must be the clock the workers time spans with (the loop's for a simulation)."""
        self._workers = dict(workers)
        self._clock = clock
        self._queued: dict[int, float] = {}
        self._on_span = on_span
        self._queues: dict[Lane, deque[int]] = {lane: deque() for lane in self._workers}
        self._busy: set[Lane] = set()
        self._nodes: dict[int, TaskNode] = {}
        self._actions: dict[int, Action] = {}
        self._unmet: dict[int, int] = {}
        self._dependents: dict[int, list[int]] = {}
        self._done: set[int] = set()
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._idle: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self.spans: list[Span] = []

    # ---- feeding

    def submit(self, node: TaskNode, action: Action = None) -> None:
        """Queue a node on its lane; it may depend on nodes not submitted yet."""
        if self._stopped:
            raise self._error or asyncio.CancelledError()
        if node.id in self._nodes:
            raise PlanError(f"node {node.id} ({node.label}) submitted twice")
        if node.lane not in self._workers:
            raise PlanError(f"node {node.id} ({node.label}) is on lane {node.lane}, which has no worker")
        if node.id in node.deps:
            raise PlanError(f"dependency cycle: {node.id} ({node.label}) depends on itself")
        self._nodes[node.id] = node
        self._actions[node.id] = action
        self._queued[node.id] = self._clock()
        unmet = 0
        for dep in node.deps:
            if dep not in self._done:
                unmet += 1
                self._dependents.setdefault(dep, []).append(node.id)
        self._unmet[node.id] = unmet
        self._queues[node.lane].append(node.id)
        self._try_start(node.lane)

    def submit_all(self, nodes: Iterable[TaskNode], actions: Mapping[int, Action] | None = None) -> None:
        for node in nodes:
            self.submit(node, (actions or {}).get(node.id))

    # ---- waiting

    async def wait(self, node_id: int) -> None:
        """Until node `node_id` is done (host-visible), or the run fails."""
        if node_id in self._done:
            return
        if self._error is not None:
            raise self._error
        future = self._futures.get(node_id)
        if future is None:
            future = self._futures[node_id] = asyncio.get_running_loop().create_future()
        self._check_stuck()
        await future

    async def drain(self) -> None:
        """Until every submitted node is done; raises the run's failure, if any."""
        while True:
            if self._error is not None and not self._busy:
                raise self._error
            if self._stopped and not self._busy:
                raise asyncio.CancelledError()
            if len(self._done) == len(self._nodes) and not self._busy:
                return
            self._idle = asyncio.get_running_loop().create_future()
            self._check_stuck()
            await self._idle

    async def settle(self) -> None:
        """Until no lane is running anything (never raises); for cleanup after a failure."""
        while self._busy:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def cancel(self) -> None:
        """Stop starting nodes (in-flight ones finish); drain then raises CancelledError."""
        self._stopped = True
        self._fail_waiters(asyncio.CancelledError())

    @property
    def pending(self) -> int:
        return len(self._nodes) - len(self._done)

    # ---- internals

    def _try_start(self, lane: Lane) -> None:
        if lane in self._busy or self._stopped:
            return
        queue = self._queues[lane]
        if not queue or self._unmet[queue[0]]:
            return
        node_id = queue.popleft()
        self._busy.add(lane)
        node = self._nodes[node_id]
        self._workers[lane].start(
            node, self._actions.pop(node_id), lambda s, e, err: self._finish(node, s, e, err)
        )

    def _finish(self, node: TaskNode, start: float, end: float, error: BaseException | None) -> None:
        self._busy.discard(node.lane)
        if error is not None:
            self._fail(node, error)
        else:
            self._done.add(node.id)
            span = Span(node, start, end, self._queued.pop(node.id))
            self.spans.append(span)
            if self._on_span is not None:
                self._on_span(span)
            future = self._futures.pop(node.id, None)
            if future is not None and not future.done():
                future.set_result(None)
            for dependent in self._dependents.pop(node.id, ()):
                self._unmet[dependent] -= 1
                if self._unmet[dependent] == 0:
                    self._try_start(self._nodes[dependent].lane)
            self._try_start(node.lane)
        self._wake()
        self._check_stuck()

    def _fail(self, node: TaskNode, error: BaseException) -> None:
        if self._error is None:
            where = f"{node.label} on {node.lane} (node {node.id})"
            failure = NodeFailed(f"{where} failed: {type(error).__name__}: {error}")
            failure.__cause__ = error
            self._error = failure
            self._stopped = True
            self._fail_waiters(failure)

    def _fail_waiters(self, error: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()
        self._wake()

    def _wake(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _check_stuck(self) -> None:
        """Nothing runs, someone waits, and no queue head can start: report why, never hang."""
        waiting = bool(self._futures) or (self._idle is not None and not self._idle.done())
        if self._busy or self._stopped or not waiting:
            return
        heads = [q[0] for q in self._queues.values() if q]
        if any(self._unmet[h] == 0 for h in heads):
            return
        if not heads:
            unknown = sorted(set(self._futures) - set(self._nodes))
            if unknown:
                self._raise_plan_error(f"waiting for node {unknown[0]}, which was never submitted")
            return
        self._raise_plan_error(self._describe_block(heads[0]))

    def _raise_plan_error(self, message: str) -> None:
        self._error = PlanError(message)
        self._stopped = True
        self._fail_waiters(self._error)

    def _describe_block(self, head: int) -> str:
        """Follow 'waits for' edges from a blocked head: to an unknown node, or round a cycle."""
        path: list[int] = []
        seen: dict[int, int] = {}
        current = head
        while current not in seen:
            seen[current] = len(path)
            path.append(current)
            blocker = self._blocker(current)
            if blocker not in self._nodes:
                return f"node {current} ({self._nodes[current].label}) depends on unknown node {blocker}"
            current = blocker
        cycle = [*path[seen[current] :], current]
        named = " -> ".join(f"{n} ({self._nodes[n].label} on {self._nodes[n].lane})" for n in cycle)
        only_deps = all(b in self._nodes[a].deps for a, b in itertools.pairwise(cycle))
        kind = (
            "dependency cycle" if only_deps else "deadlock (lane order and dependencies wait on each other)"
        )
        return f"{kind}: {named}"

    def _is_head(self, node_id: int) -> bool:
        queue = self._queues[self._nodes[node_id].lane]
        return bool(queue) and queue[0] == node_id

    def _blocker(self, node_id: int) -> int:
        """What a pending node waits for: its first unmet dependency if it heads its lane,
        otherwise the node ahead of it on its lane."""
        if self._is_head(node_id):
            return next(d for d in self._nodes[node_id].deps if d not in self._done)
        queue = self._queues[self._nodes[node_id].lane]
        return queue[queue.index(node_id) - 1]
