"""--trace-kernels: a run under torch.profiler, and the kernels and copies it saw merged into the run's
trace, as tracks under the GPU lanes that launched them.

What ran on the device comes from the profiler: CUPTI's kernels, copies and memsets on CUDA; on a
CPU-only run the CPU operations, so the whole path runs without a GPU. Each is tied to the node that
launched it through the profiler range every worker opens around a node's action while a profiler
records, named by the node's label (devices/threadpool.py, run_action):
- a device event through the CPU operation that launched it (the profiler's link between the two),
  and the node range that holds that operation on its thread;
- a CPU operation by lying inside a node range on the range's thread (the outermost operations
  only: what they call runs inside them).
A range is that of the node with its label whose submission-to-end interval holds the range's start
(a label recurs once a step; nodes without an action open no range). A CUDA stream belongs to the lane
that launched most of the kernels tied to nodes on it; a kernel launched outside every node takes
its stream's lane, or none.

The profiler's clock is not the trace's (time.perf_counter): at the start and at the end of the
recording, mark ranges are opened between two readings of the trace's clock; the narrowest reading
at each end (one the OS preempted is wider) pairs its range's middle with its own, and the
profiler's times are mapped on the line through those two points (to within a few microseconds).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from attrs import define, field, frozen
from torch.profiler import ProfilerActivity

from flowmoe.core.executor import Span
from flowmoe.core.plan import Lane
from flowmoe.traces.trace import KernelSlice, Trace

CLOCK_MARK = "flowmoe clock"  # the profiler ranges that date the recording on the trace's clock
MARK_TRIES = 8  # mark ranges at each end of the recording, the narrowest reading kept
DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}  # profiler -> slice
CPU_OP, ANNOTATION = "cpu_op", "user_annotation"
READ = {CPU_OP, ANNOTATION, *DEVICE_KINDS}  # the profiler's activity types the merge reads


@frozen(slots=True)
class ProfEvent:
    """What the merge reads of one profiler event (times in the profiler's nanoseconds)."""

    name: str
    activity: str  # the profiler's activity type: "cpu_op", "user_annotation", "kernel", "gpu_memcpy", ...
    start: int
    end: int
    resource: int  # the host thread; for a device event, the CUDA stream
    correlation: int = 0  # a CPU event's id
    linked: int = 0  # a device event: the id of the CPU event that launched it (0: none known)

    @property
    def on_device(self) -> bool:
        return self.activity in DEVICE_KINDS


@frozen
class Clock:
    """The profiler's nanoseconds as the trace's seconds: the line through two (profiler ns, trace s)
    points; `error`: seconds either way a point may be off (half the widest mark's reading)."""

    first: tuple[float, float]
    last: tuple[float, float]
    error: float = 0.0

    def __call__(self, ns: float) -> float:
        (p0, t0), (p1, t1) = self.first, self.last
        slope = (t1 - t0) / (p1 - p0) if p1 > p0 else 1e-9
        return t0 + (ns - p0) * slope

    @classmethod
    def from_marks(cls, marks: Mapping[str, ProfEvent], readings: Mapping[str, tuple[int, int]]) -> Clock:
        """At each end of the recording, the mark range (by name) whose trace-clock readings around it
        (perf_counter_ns before opening and after closing it) are the narrowest: its middle against
        theirs."""
        points, error = [], 0.0
        for end in ("start", "end"):
            names = [name for name in readings if name.startswith(f"{CLOCK_MARK} {end} ") and name in marks]
            if not names:
                raise ValueError(f"the profiler kept no clock mark at the {end} of the recording")
            best = min(names, key=lambda name: readings[name][1] - readings[name][0])
            (before, after), mark = readings[best], marks[best]
            points.append(((mark.start + mark.end) / 2, (before + after) / 2e9))
            error = max(error, (after - before) / 2e9)
        return cls(points[0], points[1], error)


@define
class KernelProfiler:
    """`with KernelProfiler(trace, cuda):` runs the block under torch.profiler (every thread, the lane
    threads started before it too; CUDA activity where `cuda`) and, however the block ends, merges
    what ran into `trace` (its spans must be in it by then: a runtime keeps each step's as it ends)."""

    trace: Trace
    cuda: bool
    kernels: int = 0  # slices merged
    _profile: Any = None  # torch.profiler.profile while recording
    _readings: dict[str, tuple[int, int]] = field(factory=dict)  # the trace clock around each mark (ns)

    def __enter__(self) -> KernelProfiler:
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        every_thread = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        self._profile = torch.profiler.profile(activities=activities, experimental_config=every_thread)
        self._profile.__enter__()
        self._readings = {}
        self._mark("start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._mark("end")
        self._profile.__exit__(*exc)
        events = list(prof_events(self._profile.profiler.kineto_results.events()))
        self._profile = None
        marks = {e.name: e for e in events if e.activity == ANNOTATION and e.name.startswith(CLOCK_MARK)}
        slices = kernel_slices(events, Clock.from_marks(marks, self._readings), self.trace.spans, self.cuda)
        self.trace.kernels.extend(slices)
        self.kernels += len(slices)

    def _mark(self, end: str) -> None:
        for i in range(MARK_TRIES):
            name = f"{CLOCK_MARK} {end} {i}"
            before = time.perf_counter_ns()
            with torch.profiler.record_function(name):
                pass
            self._readings[name] = (before, time.perf_counter_ns())


def kernels_into(trace: Trace, cuda: bool, on: bool) -> AbstractContextManager[object]:
    """A KernelProfiler into `trace` where `on` (--trace-kernels); else a context that does nothing."""
    return KernelProfiler(trace, cuda) if on else nullcontext()


def prof_events(events: Iterable[Any]) -> Iterable[ProfEvent]:
    """The profiler's events (torch's _KinetoEvent) the merge reads."""
    for e in events:
        activity = activity_of(e)
        if activity in READ:
            start = e.start_ns()
            yield ProfEvent(e.name(), activity, start, start + e.duration_ns(), e.device_resource_id(),
                            e.correlation_id(), e.linked_correlation_id())  # fmt: skip


def activity_of(event: Any) -> str:
    """A profiler event's activity type: torch's own where its events say (`activity_type`, torch
    2.12 on); on torch 2.11, whose events lack it (seen on the H200 run), told from the device it ran
    on and its name: a device event is a memcpy or memset by its name ("Memcpy HtoD ...", "Memset
    ..."), else a kernel; a host event is an annotation (a record_function range) where torch says so,
    or where its name has no operator namespace ("aten::add"), else an operation."""
    own = getattr(event, "activity_type", None)
    if own is not None:
        return str(own())
    if event.device_type() != torch.autograd.DeviceType.CPU:
        copies = {"Memcpy": "gpu_memcpy", "Memset": "gpu_memset"}
        return copies.get(event.name().split(" ", 1)[0], "kernel")
    annotation = getattr(event, "is_user_annotation", None)
    if annotation is not None:
        return ANNOTATION if annotation() else CPU_OP
    return CPU_OP if "::" in event.name() else ANNOTATION


@frozen(slots=True)
class NodeRange:
    """A node's profiler range on its thread (profiler ns) and the node's span."""

    start: int
    end: int
    span: Span


def node_ranges(
    events: Sequence[ProfEvent], clock: Clock, spans: Sequence[Span]
) -> dict[int, list[NodeRange]]:
    """The ranges named by a node's label, each tied to its node's span, by thread, in start order."""
    by_label: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_label[span.node.label].append(span)
    queued = {}
    for label, group in by_label.items():
        group.sort(key=lambda s: s.queued)
        queued[label] = [s.queued for s in group]
    taken: set[int] = set()
    ranges: dict[int, list[NodeRange]] = defaultdict(list)
    annotations = (e for e in events if e.activity == ANNOTATION and e.name in by_label)
    for event in sorted(annotations, key=lambda e: e.start):
        node = _span_at(by_label[event.name], queued[event.name], clock(event.start), clock.error, taken)
        if node is not None:
            taken.add(node.node.id)
            ranges[event.resource].append(NodeRange(event.start, event.end, node))
    for found in ranges.values():
        found.sort(key=lambda r: r.start)
    return ranges


def _span_at(group: list[Span], queued: list[float], at: float, error: float, taken: set[int]) -> Span | None:
    """The latest-submitted span of `group` not yet taken that was submitted by `at` and ends after
    it (each to within `error`)."""
    for i in range(bisect.bisect_right(queued, at + error) - 1, -1, -1):
        span = group[i]
        if span.node.id not in taken and span.end >= at - error:
            return span
    return None


def _range_at(ranges: list[NodeRange], starts: list[int], start: int, end: int) -> NodeRange | None:
    """The range of `ranges` (in start order, `starts` their starts) that holds [start, end]."""
    i = bisect.bisect_right(starts, start) - 1
    return ranges[i] if i >= 0 and ranges[i].end >= end else None


def kernel_slices(
    events: Sequence[ProfEvent], clock: Clock, spans: Sequence[Span], device: bool
) -> list[KernelSlice]:
    """What ran for the GPU lanes, on the trace's clock in start order: the device events (`device`),
    or else the outermost CPU operations of each node on a GPU lane."""
    ranges = node_ranges(events, clock, spans)
    starts = {thread: [r.start for r in found] for thread, found in ranges.items()}
    if device:
        slices = _device_slices(events, clock, LaneSpans.of(spans), ranges, starts)
    else:
        slices = _cpu_slices(events, clock, ranges, starts)
    return sorted(slices, key=lambda s: s.start)


def _cpu_slices(
    events: Sequence[ProfEvent],
    clock: Clock,
    ranges: dict[int, list[NodeRange]],
    starts: dict[int, list[int]],
) -> list[KernelSlice]:
    slices = []
    reach: dict[int, int] = {}  # a node's end of its last outermost operation so far
    ops = sorted((e for e in events if e.activity == CPU_OP and e.resource in ranges), key=lambda e: e.start)
    for op in ops:
        found = _range_at(ranges[op.resource], starts[op.resource], op.start, op.end)
        if found is None or not found.span.node.lane.on_gpu:
            continue
        node = found.span.node
        if op.start < reach.get(node.id, -1):  # inside an operation already kept
            continue
        reach[node.id] = op.end
        slices.append(
            KernelSlice(op.name, "cpu_op", clock(op.start), clock(op.end), node.lane, op.resource, node.id)
        )
    return slices


@frozen
class LaneSpans:
    """The GPU lanes' spans in start order (a lane runs one node at a time), to find the one holding
    a time on the trace's clock."""

    spans: dict[Lane, list[Span]]
    starts: dict[Lane, list[float]]

    @classmethod
    def of(cls, spans: Sequence[Span]) -> LaneSpans:
        by_lane: dict[Lane, list[Span]] = defaultdict(list)
        for span in sorted(spans, key=lambda s: s.start):
            if span.node.lane.on_gpu:
                by_lane[span.node.lane].append(span)
        return cls(dict(by_lane), {lane: [s.start for s in found] for lane, found in by_lane.items()})

    def at(self, lane: Lane, time: float) -> Span | None:
        found = self.spans.get(lane, [])
        i = bisect.bisect_right(self.starts.get(lane, []), time) - 1
        return found[i] if i >= 0 and found[i].end >= time else None


def _device_slices(
    events: Sequence[ProfEvent],
    clock: Clock,
    lane_spans: LaneSpans,
    ranges: dict[int, list[NodeRange]],
    starts: dict[int, list[int]],
) -> list[KernelSlice]:
    """Each device event tied to its node through its launcher where the profiler linked one; a
    stream's lane by its linked kernels' nodes, or where none is linked, by the GPU spans that hold
    its kernels (the lanes' spans are device time: a node's kernels run inside its span); an event
    without a launcher in a node range goes to the span of its stream's lane that holds it."""
    device = [e for e in events if e.on_device]
    wanted = {e.linked for e in device if e.linked}
    launchers = {e.correlation: e for e in events if not e.on_device and e.correlation in wanted}
    launched = [_launched_by(launchers.get(e.linked), ranges, starts) for e in device]
    middles = [clock((e.start + e.end) / 2) for e in device]
    votes: dict[int, Counter[Lane]] = defaultdict(Counter)  # stream -> lanes of its linked kernels' nodes
    for event, span in zip(device, launched, strict=True):
        if span is not None and span.node.lane.on_gpu:
            votes[event.resource][span.node.lane] += 1
    linked = set(votes)
    for event, middle in zip(device, middles, strict=True):
        if event.resource not in linked:  # no kernel of its stream linked: by the spans holding them
            for lane in lane_spans.spans:
                votes[event.resource][lane] += lane_spans.at(lane, middle) is not None
    lanes = {stream: count.most_common(1)[0][0] for stream, count in votes.items() if count.total()}
    slices = []
    for event, span, middle in zip(device, launched, middles, strict=True):
        stream_lane = lanes.get(event.resource)
        if span is None and stream_lane is not None:
            span = lane_spans.at(stream_lane, middle)
        slices.append(
            KernelSlice(
                event.name,
                DEVICE_KINDS[event.activity],
                clock(event.start),
                clock(event.end),
                stream_lane,
                event.resource,
                None if span is None else span.node.id,
            )
        )
    return slices


def _launched_by(
    launcher: ProfEvent | None, ranges: dict[int, list[NodeRange]], starts: dict[int, list[int]]
) -> Span | None:
    """The span of the node whose range holds `launcher` on its thread."""
    if launcher is None or launcher.resource not in ranges:
        return None
    found = _range_at(ranges[launcher.resource], starts[launcher.resource], launcher.start, launcher.end)
    return None if found is None else found.span
