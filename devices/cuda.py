"""CudaStreamWorker: the GPU lanes on CUDA streams, cross-lane order through CUDA events.

Each GPU lane owns a stream and a launch thread. A node waits for producers on
other streams with `stream.wait_event`, so the host never blocks on GPU work
it only needs to order; a blocking sync inside an action (a routing count read
back to the host) stalls that lane's launch thread only, never the event loop.
CPU-lane nodes that consume GPU results wait on the producer's event on their
own thread (`EventBook.wait_host`). Spans are timed with CUDA events against
one anchor event, then mapped onto the host clock.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from flowmoe.core.executor import Action, Finish, Span
from flowmoe.core.plan import Lane, TaskNode


class EventBook:
    """CUDA begin/end events of every GPU node of a run, and the anchor that dates them."""

    def __init__(self, device: torch.device) -> None:
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Stream]] = {}
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        self._anchor_host = time.perf_counter()

    def put(
        self, node_id: int, begin: torch.cuda.Event, end: torch.cuda.Event, stream: torch.cuda.Stream
    ) -> None:
        self._events[node_id] = (begin, end, stream)

    def wait_gpu(self, node: TaskNode, stream: torch.cuda.Stream) -> None:
        """Order `stream` after every GPU producer of `node` that ran on another stream."""
        for dep in node.deps:
            entry = self._events.get(dep)
            if entry is not None and entry[2] != stream:
                stream.wait_event(entry[1])

    def wait_host(self, node: TaskNode) -> None:
        """Block this (lane) thread until every GPU producer of `node` has finished."""
        for dep in node.deps:
            entry = self._events.get(dep)
            if entry is not None:
                entry[1].synchronize()

    def retime(self, span: Span) -> Span:
        """The span of a GPU node with its real GPU start and end (call after synchronizing)."""
        entry = self._events.get(span.node.id)
        if entry is None:
            return span
        begin, end, _ = entry
        start = self._anchor_host + self._anchor.elapsed_time(begin) / 1e3
        return Span(span.node, start, self._anchor_host + self._anchor.elapsed_time(end) / 1e3, span.queued)


class CudaStreamWorker:
    def __init__(self, device: torch.device, events: EventBook) -> None:
        self._device = device
        self._events = events
        self._streams: dict[Lane, torch.cuda.Stream] = {}
        self._pools: dict[Lane, ThreadPoolExecutor] = {}

    def stream(self, lane: Lane) -> torch.cuda.Stream:
        if lane not in self._streams:
            self._streams[lane] = torch.cuda.Stream(self._device)
        return self._streams[lane]

    def start(self, node: TaskNode, action: Action, finish: Finish) -> None:
        pool = self._pools.get(node.lane)
        if pool is None:
            pool = self._pools[node.lane] = ThreadPoolExecutor(1, thread_name_prefix=f"flowmoe-{node.lane}")
        pool.submit(self._launch, node, action, finish)

    def _launch(self, node: TaskNode, action: Action, finish: Finish) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            stream = self.stream(node.lane)
            self._events.wait_gpu(node, stream)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                begin.record(stream)
                if action is not None:
                    with torch.cuda.nvtx.range(node.label), torch.profiler.record_function(node.label):
                        action()
                end.record(stream)
            self._events.put(node.id, begin, end, stream)
        except BaseException as exc:  # reported through the executor, which names the node
            error = exc
        finish(start, time.perf_counter(), error)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
