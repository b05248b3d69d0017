"""The dataflow executor: one queue per lane, nodes start in emission order once their deps are done.

Nodes arrive as a stream (`submit`) while the run is in progress, because a
scheduler learns a layer's routing only after its gate ran. The executor is
callback driven: a worker is told to start a node and calls `finish` when it has
finished (or, for a CUDA stream, when it is enqueued behind its producers'
events). `finish` may be called from any thread: the worker thread that ran a
node starts whatever that released right there, so a lane's next node follows
without a round trip through the event loop; the loop is only woken for the
futures someone awaits (`wait`, `drain`).

Failures never hang: a dependency that never arrives, a cycle, or lane order
and dependencies waiting on each other are reported with the nodes involved; the
first node that raises stops every lane from starting anything new and surfaces
as NodeFailed naming the node. So does an exception in the executor's own
hand-off after a node (a span callback that raises, a worker that refuses a
node): the lanes it had claimed are released and every waiter is told.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
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
    # where start and end are the device's (a CUDA node, retimed from its events): the seconds its
    # launching thread spent in the launch, waits for the device inside the node's action included
    launch: float | None = None


class Worker(Protocol):
    """Runs nodes of the lanes it serves and calls `finish(start, end, error)` from any thread.

    A worker that runs nodes on the event loop's thread may also offer `run_started()`, which runs
    the nodes started on it so far right away, on the calling thread; the executor calls it
    before it waits for a node, so a chain of such nodes costs no trip through the loop."""

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None: ...

    def close(self) -> None: ...


Start = tuple[TaskNode, Action]


class Executor:
    def __init__(
        self,
        workers: Mapping[Lane, Worker],
        on_span: Callable[[Span], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        keep_spans: bool = True,
    ) -> None:
        """`clock` must be the clock the workers time spans with (the loop's for a simulation);
        `keep_spans`: keep every node's span in `spans` (False: a span is made only for `on_span`,
        and none at all without one)."""
        self._workers = dict(workers)
        unique = {id(w): w for w in self._workers.values()}.values()
        self._run_here: list[Callable[[], None]] = [
            run for w in unique if (run := getattr(w, "run_started", None)) is not None
        ]
        self._clock = clock
        self._on_span = on_span
        self._keep = keep_spans
        self._timed = keep_spans or on_span is not None  # spans are made
        self._starts = {lane: w.start for lane, w in self._workers.items()}  # each lane's worker's `start`
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._queued: dict[int, float] = {}
        self._queues: dict[Lane, deque[Start]] = {lane: deque() for lane in self._workers}
        self._busy: set[Lane] = set()
        self._nodes: dict[int, TaskNode] = {}
        self._unmet: dict[int, int] = {}
        self._dependents: dict[int, list[int]] = {}
        self._done: set[int] = set()
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._idle: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self.spans: list[Span] = []

    # ---- feeding (loop thread)

    def submit(self, node: TaskNode, action: Action = None) -> None:
        """Queue a node on its lane; it may depend on nodes not submitted yet."""
        if self._loop is None:
            self._bind_loop()
        node_id, lane, deps = node.id, node.lane, node.deps
        with self._lock:
            if self._stopped:
                raise self._error or asyncio.CancelledError()
            queue = self._queues.get(lane)
            if queue is None or node_id in self._nodes or node_id in deps:
                self._validate(node)
            assert queue is not None  # _validate raised for a lane without a worker
            self._nodes[node_id] = node
            if self._timed:
                self._queued[node_id] = self._clock()
            unmet = 0
            done, dependents = self._done, self._dependents
            for dep in deps:
                if dep not in done:
                    unmet += 1
                    waiting = dependents.get(dep)
                    if waiting is None:
                        dependents[dep] = [node_id]
                    else:
                        waiting.append(node_id)
            if unmet or queue or lane in self._busy:  # it waits: for its deps, or behind its lane's head
                self._unmet[node_id] = unmet  # a queued node's count (`_finish` and `_check_stuck` read it)
                queue.append((node, action))
                return
            self._busy.add(lane)
        self._start(node, action)

    def submit_all(self, nodes: Iterable[TaskNode], actions: Mapping[int, Action] | None = None) -> None:
        for node in nodes:
            self.submit(node, (actions or {}).get(node.id))

    def _validate(self, node: TaskNode) -> None:
        """Raise the PlanError that explains why `node` may not be submitted."""
        if node.id in self._nodes:
            raise PlanError(f"node {node.id} ({node.label}) submitted twice")
        if node.lane not in self._workers:
            raise PlanError(f"node {node.id} ({node.label}) is on lane {node.lane}, which has no worker")
        if node.id in node.deps:
            raise PlanError(f"dependency cycle: {node.id} ({node.label}) depends on itself")

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()

    # ---- waiting (loop thread)

    async def wait(self, node_id: int) -> None:
        """Until node `node_id` is done (host-visible), or the run fails."""
        self._bind_loop()
        if node_id not in self._done:
            self._run_started()
        with self._lock:
            if node_id in self._done:
                return
            if self._error is not None:
                raise self._error
            future = self._futures.get(node_id)
            if future is None:
                future = self._futures[node_id] = self._loop.create_future()  # type: ignore[union-attr]  # bound (_bind_loop) before any wait
            self._check_stuck()
        await future

    async def drain(self) -> None:
        """Until every submitted node is done; raises the run's failure, if any."""
        self._bind_loop()
        while True:
            self._run_started()
            with self._lock:
                if self._error is not None and not self._busy:
                    raise self._error
                if self._stopped and not self._busy:
                    raise asyncio.CancelledError()
                if len(self._done) == len(self._nodes) and not self._busy:
                    return
                self._idle = idle = self._loop.create_future()  # type: ignore[union-attr]  # bound (_bind_loop) before any wait
                self._check_stuck()
            await idle

    async def settle(self) -> None:
        """Until no lane is running anything (never raises); for cleanup after a failure."""
        self._bind_loop()
        while True:
            with self._lock:
                if not self._busy:
                    return
                self._idle = idle = self._loop.create_future()  # type: ignore[union-attr]  # bound (_bind_loop) before any wait
            await idle

    def _run_started(self) -> None:
        """What the loop-thread workers have started, run here (an interrupt inside goes on)."""
        for run in self._run_here:
            run()

    def cancel(self) -> None:
        """Stop starting nodes (in-flight ones finish); drain then raises CancelledError."""
        with self._lock:
            self._stopped = True
            self._fail_waiters(asyncio.CancelledError())

    @property
    def pending(self) -> int:
        return len(self._nodes) - len(self._done)

    # ---- running (any thread)

    def _start(self, node: TaskNode, action: Action) -> None:
        """Hand a node whose lane it has claimed to the lane's worker."""
        try:
            self._starts[node.lane](node, action, partial(self._finish, node))
        except BaseException as exc:  # a worker that cannot take the node: the lane is not running it
            self._crash(node, exc, "could not start", [(node, action)])

    def _finish(self, node: TaskNode, start: float, end: float, error: BaseException | None) -> None:
        """Called once per started node, from any thread; never raises (a failure here fails the
        run). The span callback runs first, so a node is done only once it is recorded. Then, under
        the lock, `node` is marked done, its dependents are released, and the lanes that may start
        are claimed (their heads appended to `starts` as it goes, so a failure midway knows what it
        claimed), its own lane's first, then those of the dependents it released, in their order."""
        span = None
        if self._timed and error is None:
            span = Span(node, start, end, self._queued.pop(node.id))  # only this node's thread pops it
            if self._on_span is not None:
                try:
                    self._on_span(span)
                except BaseException as exc:
                    self._crash(node, exc, "failed in its span callback", [])
                    return
        starts: list[Start] = []
        try:
            with self._lock:
                busy, lane = self._busy, node.lane
                busy.discard(lane)
                if error is not None:
                    self._fail(node, error)
                else:
                    node_id = node.id
                    self._done.add(node_id)
                    if span is not None and self._keep:
                        self.spans.append(span)
                    if self._futures:
                        future = self._futures.pop(node_id, None)
                        if future is not None:
                            self._resolve(future, None)
                    take = self._take
                    take(lane, starts)  # its lane's next node
                    dependents = self._dependents.pop(node_id, None)
                    if dependents:
                        unmet, nodes = self._unmet, self._nodes
                        for dependent in dependents:
                            left = unmet[dependent] = unmet[dependent] - 1
                            if not left:
                                take(nodes[dependent].lane, starts)
                if self._idle is not None or self._futures:  # someone waits (`_check_stuck`'s own test)
                    if self._idle is not None and (not busy or self._error is not None):
                        self._wake()
                    self._check_stuck()
        except BaseException as exc:
            self._crash(node, exc, "failed in the executor's hand-off", starts)
            return
        for next_node, action in starts:
            self._start(next_node, action)

    def _take(self, lane: Lane, starts: list[Start]) -> None:
        """Under the lock: the lane's head claimed (the lane then busy) and appended to `starts`, where
        it may start now."""
        queue = self._queues[lane]
        if queue and lane not in self._busy and not self._stopped and not self._unmet[queue[0][0].id]:
            self._busy.add(lane)
            starts.append(queue.popleft())

    def _crash(self, node: TaskNode, error: BaseException, what: str, claimed: list[Start]) -> None:
        """The executor itself failed around `node`: release the lanes claimed for nodes that will
        not start, fail the run naming `node`, wake every waiter. An interrupt (Ctrl-C, raised on
        the main thread wherever it was) then goes on, so the command ends as interrupted."""
        with self._lock:
            self._busy.discard(node.lane)  # whatever ran (or was to run) `node` holds its lane no more
            for claimed_node, _ in claimed:
                self._busy.discard(claimed_node.lane)
            self._fail(node, error, what)
            self._wake()
        if not isinstance(error, Exception):
            raise error

    def _fail(self, node: TaskNode, error: BaseException, what: str = "failed") -> None:
        if self._error is None:
            where = f"{node.label} on {node.lane} (node {node.id})"
            failure = NodeFailed(f"{where} {what}: {type(error).__name__}: {error}")
            failure.__cause__ = error
            self._error = failure
            self._stopped = True
            self._fail_waiters(failure)

    # ---- notifying the loop (under the lock)

    def _resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        def settle() -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(None)

        if threading.get_ident() == self._loop_thread:
            settle()
        else:
            self._loop.call_soon_threadsafe(settle)  # type: ignore[union-attr]  # bound when a node ran

    def _fail_waiters(self, error: BaseException) -> None:
        for future in self._futures.values():
            self._resolve(future, error)
        self._futures.clear()
        self._wake()

    def _wake(self) -> None:
        if self._idle is not None:
            self._resolve(self._idle, None)
            self._idle = None

    # ---- never hang

    def _check_stuck(self) -> None:
        """Nothing runs, someone waits, and no queue head can start: report why."""
        waiting = bool(self._futures) or self._idle is not None
        if self._busy or self._stopped or not waiting:
            return
        heads = [q[0][0].id for q in self._queues.values() if q]
        if any(self._unmet[h] == 0 for h in heads):
            return
        if not heads:
            unknown = sorted(set(self._futures) - set(self._nodes))
            if unknown:
                self._plan_error(f"waiting for node {unknown[0]}, which was never submitted")
            return
        self._plan_error(self._describe_block(heads[0]))

    def _plan_error(self, message: str) -> None:
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
        if only_deps:
            return f"dependency cycle: {named}"
        return f"deadlock (lane order and dependencies wait on each other): {named}"

    def _blocker(self, node_id: int) -> int:
        """What a pending node waits for: its first unmet dependency if it heads its lane,
        otherwise the node ahead of it on its lane."""
        queued = [node.id for node, _ in self._queues[self._nodes[node_id].lane]]
        if queued and queued[0] == node_id:
            return next(d for d in self._nodes[node_id].deps if d not in self._done)
        return queued[queued.index(node_id) - 1]
