"""CudaStreamWorker: the GPU lanes on CUDA streams, cross-lane order through CUDA events.

Each GPU lane owns a stream and a launch thread (whose current device and
stream are set once, when the thread starts). A node waits for producers on
other streams with `stream.wait_event`, so the host never blocks on GPU work
it only needs to order; producers on its own stream are ordered by the stream
itself. CPU-lane nodes that consume GPU results wait on the producer's event on
their own thread (`EventBook.wait_host`).

The compute lane's launches run ahead of its stream by at most `run_ahead` nodes (the environment's
FLOWMOE_CUDA_RUN_AHEAD, default 2; 0: unbounded): before its k-th node of a step the lane's thread
waits on the end event of its (k - run_ahead)-th, a blocking event, so it sleeps in the driver. The
executor counts a GPU node done once launched, so without the bound the lane runs ahead until a
read-back inside an action makes it wait for the device (the LM head copies its logits back; at
8fcf0a3 a gate's `torch.bincount` also read its input's min and max back). Those are stream
synchronizations, which spin under CUDA's default scheduling whatever the events' flags: on the H200
(run 4, 8fcf0a3) the compute lane's thread spun through ~0.4 s of each 0.48 s decode step at the
gates, waiting for the experts before them, which wait for their copies (bench/RESULTS.md;
`flowmoe.study.realtime.replay_host` replays it). The gate now counts without a read-back; with the
bound the thread sleeps until two nodes before a read-back have run, which then finds the stream
nearly drained. The copy lanes read nothing back and run unbounded (their queue keeps the link busy).

Events come from a pool and go back to it when the step ends (`end_step`), so
a run holds a step's worth of events, not two per node it ever ran. Spans are
timed with CUDA events against an anchor event re-recorded at every step end
(float32 `elapsed_time` from one anchor at run start would lose resolution as
the run grows long), then mapped onto the host clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import torch
from torch import cuda

from flowmoe.core.errors import ConfigError
from flowmoe.core.executor import Action, Finish, Span
from flowmoe.core.plan import Lane, TaskNode
from flowmoe.devices.threadpool import LaneThreads, run_action

Entry = tuple["cuda.Event", "cuda.Event", "cuda.Stream"]
NVTX = os.environ.get("FLOWMOE_NVTX") == "1"  # name each node in Nsight Systems (costs µs per node)
RUN_AHEAD = "FLOWMOE_CUDA_RUN_AHEAD"  # nodes the compute lane may launch ahead of its stream (0: unbounded)
DEFAULT_RUN_AHEAD = 2
BOUNDED_LANES = frozenset({Lane.GPU_COMPUTE})  # the GPU lanes whose actions read the device back


def run_ahead_setting() -> int:
    """The bound on the compute lane's launches ahead of its stream, from FLOWMOE_CUDA_RUN_AHEAD
    (unset or empty: 2; 0: unbounded)."""
    text = os.environ.get(RUN_AHEAD, "").strip() or str(DEFAULT_RUN_AHEAD)
    if not text.isdigit():
        raise ConfigError(f"{RUN_AHEAD}={text!r}: a whole number of GPU nodes (0: unbounded)")
    return int(text)


class EventBook:
    """The begin/end events of the GPU nodes of the current step, the pool they are drawn from, and
    the anchor that dates them."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._events: dict[int, Entry] = {}
        self._free: list[cuda.Event] = []
        self._lock = threading.Lock()
        self.anchor_slack = 0.0  # seconds: the anchor's host time is at most this late
        self.step = 0  # steps ended: an event taken in an earlier step may be recorded again since
        self._anchor, self._anchor_host = self._reanchor()

    def take(self) -> cuda.Event:
        """A timing event from the pool (a new one when the pool is empty). Blocking: a host wait on it
        (a routing's counts, a CPU lane's GPU producer) sleeps in the driver instead of spinning.
        With CUDA's default spin the waiting lane thread burned its CPU for as long as the device
        was behind: on the H200 (bench/gpu-runs/2026-11-28-h200) the compute lane's thread used
        ~90% of the wall time of every link-bound decode step (cgopipe 0.425 of 0.481 s, on-demand
        2.08 of 2.30 s), CPU a co-tenant or the CPU lanes could use."""
        try:
            return self._free.pop()  # atomic: lane threads take concurrently
        except IndexError:
            return cuda.Event(enable_timing=True, blocking=True)

    def release(self, event: cuda.Event) -> None:
        """Give back an event no one waits on any more."""
        self._free.append(event)

    def put(self, node_id: int, begin: cuda.Event, end: cuda.Event, stream: cuda.Stream) -> None:
        self._events[node_id] = (begin, end, stream)

    def entry(self, node_id: int) -> Entry | None:
        return self._events.get(node_id)

    def wait_gpu(self, node: TaskNode, stream: cuda.Stream) -> None:
        """Order `stream` after every GPU producer of `node` that ran on another stream."""
        for dep in node.deps:
            entry = self._events.get(dep)
            if entry is not None and entry[2] is not stream:
                stream.wait_event(entry[1])

    def wait_host(self, node: TaskNode) -> None:
        """Block this (lane) thread until every GPU producer of `node` has finished."""
        for dep in node.deps:
            entry = self._events.get(dep)
            if entry is not None:
                entry[1].synchronize()

    def end_step(self, spans: list[Span] | None) -> list[Span]:
        """After a step's last node: its GPU spans retimed from their events (`spans` given: waits for
        the device, then re-anchors), and every event back to the pool. Every wait on this step's
        events has been issued by then, so they may be recorded again."""
        retimed: list[Span] = []
        if spans is not None:
            cuda.synchronize(self._device)
            retimed = [self.retime(s) for s in spans]
            self._anchor, self._anchor_host = self._reanchor(self._anchor)
        with self._lock:
            for begin, end, _ in self._events.values():
                self._free += (begin, end)
            self._events.clear()
            self.step += 1
        return retimed

    def close(self) -> None:
        """Drop every event, pooled or of the step (the runtime is closing)."""
        with self._lock:
            self._events.clear()
            self._free.clear()

    def _reanchor(self, event: cuda.Event | None = None) -> tuple[cuda.Event, float]:
        """Record the anchor on an idle device and read the host clock once it has passed."""
        anchor = event or cuda.Event(enable_timing=True)
        before = time.perf_counter()
        anchor.record(cuda.current_stream(self._device))
        anchor.synchronize()
        host = time.perf_counter()
        self.anchor_slack = host - before
        return anchor, host

    def retime(self, span: Span) -> Span:
        """The span of a GPU node with its real GPU start and end (its events have completed)."""
        entry = self._events.get(span.node.id)
        if entry is None:
            return span
        begin, end, _ = entry
        start = self._anchor_host + self._anchor.elapsed_time(begin) / 1e3
        end_at = self._anchor_host + self._anchor.elapsed_time(end) / 1e3
        return Span(span.node, start, end_at, span.queued, launch=span.end - span.start)


class CudaStreamWorker:
    def __init__(
        self, device: torch.device, events: EventBook, nvtx: bool = NVTX, run_ahead: int | None = None
    ) -> None:
        """`run_ahead`: nodes the compute lane may launch ahead of its stream (None:
        FLOWMOE_CUDA_RUN_AHEAD's; 0: unbounded)."""
        self._device = device
        self._events = events
        self._nvtx = nvtx
        self._run_ahead = run_ahead_setting() if run_ahead is None else run_ahead
        self._ahead: dict[Lane, deque[tuple[int, cuda.Event]]] = {}  # lane -> (step, end event), its thread's
        self._streams: dict[Lane, cuda.Stream] = {}
        self._lock = threading.Lock()
        self._lanes = LaneThreads(self._launch, prefix="flowmoe-cuda", init=self._bind)

    def stream(self, lane: Lane) -> cuda.Stream:
        with self._lock:
            if lane not in self._streams:
                self._streams[lane] = cuda.Stream(self._device)
            return self._streams[lane]

    def _bind(self, lane: Lane) -> None:
        """On the lane's thread, once: the device and the lane's stream become current there."""
        cuda.set_device(self._device)
        cuda.set_stream(self.stream(lane))

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        self._lanes.put(node, action, finish)

    def _launch(self, node: TaskNode, action: Action, finish: Finish) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        events = self._events
        try:
            stream = self._streams[node.lane]
            ahead = self._hold(node.lane)
            start = time.perf_counter()  # the launch's host time leaves the bound's sleep out
            events.wait_gpu(node, stream)
            begin, end = events.take(), events.take()
            begin.record(stream)
            if action is not None:
                if self._nvtx:
                    cuda.nvtx.range_push(node.label)
                try:
                    run_action(node, action)
                finally:
                    if self._nvtx:
                        cuda.nvtx.range_pop()
            end.record(stream)
            events.put(node.id, begin, end, stream)
            if ahead is not None:
                ahead.append((events.step, end))
        except BaseException as exc:  # reported through the executor, which names the node
            error = exc
        finish(start, time.perf_counter(), error)

    def _hold(self, lane: Lane) -> deque[tuple[int, cuda.Event]] | None:
        """On a bounded lane, sleep until its node `run_ahead` launches back has ended on the device
        (its blocking end event); -> the lane's launched end events (None: unbounded)."""
        if not self._run_ahead or lane not in BOUNDED_LANES:
            return None
        ahead = self._ahead.setdefault(lane, deque())
        step = self._events.step
        while ahead and ahead[0][0] != step:  # an earlier step's: back in the pool, maybe taken again
            ahead.popleft()
        if len(ahead) >= self._run_ahead:
            ahead.popleft()[1].synchronize()
        return ahead

    def close(self) -> None:
        self._lanes.close()
