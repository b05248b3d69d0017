"""What the device did inside the GPU lanes' spans, from the kernel tracks --trace-kernels writes.

A GPU node's span runs from its begin event to its end event on the lane's stream: the device idles
inside it whenever the host has not launched the node's next kernel yet. With the kernels that ran:
- a lane's device-busy time: the union of its kernels' intervals (per step window, weighted as the
  run statistics are, traces/stats.py);
- its launch gap: the part of its span-busy time (the union of its spans) no kernel of it covers,
  as a share of the span-busy time;
- a launch-bound node: a GPU node whose span is at least LAUNCH_BOUND times its kernels' busy time
  (the device idled inside it longer than it worked); its wasted time is the span less the kernels'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from attrs import frozen

from flowmoe.traces.stats import RunStats, SpanRecord, Window, split, union_us

LAUNCH_BOUND = 2.0  # span / kernel time at which a node counts as launch-bound (idle longer than busy)
TOP = 10  # launch-bound nodes listed


@frozen
class KernelRecord:
    """One kernel (or copy, or CPU operation) of a kernel track, in microseconds."""

    lane: str | None  # the GPU lane whose stream ran it (None: a stream no node launched on)
    node: int | None  # the node that launched it, where known
    start: float
    end: float


@frozen
class DeviceLane:
    lane: str
    span_busy_seconds: float  # the union of the lane's spans (the run statistics' busy time)
    device_busy_seconds: float  # the union of the lane's kernels
    gap_seconds: float  # span-busy time no kernel of the lane covers
    makespan_seconds: float

    @property
    def device_share(self) -> float:
        """Device-busy time over the makespan."""
        return self.device_busy_seconds / self.makespan_seconds if self.makespan_seconds else 0.0

    @property
    def gap_share(self) -> float:
        """The launch gap's share of the lane's span-busy time."""
        return self.gap_seconds / self.span_busy_seconds if self.span_busy_seconds else 0.0


@frozen
class LaunchBound:
    id: int
    label: str
    lane: str
    span_us: float
    kernel_us: float  # the union of its kernels

    @property
    def wasted_us(self) -> float:
        return self.span_us - self.kernel_us


@frozen
class DeviceStats:
    lanes: tuple[DeviceLane, ...]
    launch_bound: tuple[LaunchBound, ...]  # the TOP launch-bound nodes by wasted time
    bound_nodes: int  # launch-bound GPU nodes, of
    gpu_nodes: int  # GPU nodes


def device_stats(
    stats: RunStats,
    records: Sequence[SpanRecord],
    kernels: Sequence[KernelRecord],
    windows: Sequence[Window] = (),
) -> DeviceStats:
    """The device figures of `records` and their `kernels`; `stats` are the records' run statistics
    (their lanes' span-busy times and makespan); without windows the whole trace is one step."""
    gpu = [r for r in records if r.lane.startswith("gpu")]
    if not windows:
        times = [(r.start, r.end) for r in gpu] + [(k.start, k.end) for k in kernels]
        windows = [Window(min(t[0] for t in times), max(t[1] for t in times))] if times else []
    windows = sorted(windows, key=lambda w: w.start)
    device: dict[str, float] = defaultdict(float)
    gaps: dict[str, float] = defaultdict(float)
    for window, spans, ran in zip(windows, split(gpu, windows), split(kernels, windows), strict=True):
        for lane, (lane_spans, lane_kernels) in _by_lane(spans, ran).items():
            busy = union_us(lane_kernels)
            device[lane] += window.weight * busy
            covered = union_us(lane_spans) + busy - union_us([*lane_spans, *lane_kernels])
            gaps[lane] += window.weight * (union_us(lane_spans) - covered)
    span_busy = {lane.lane: lane.busy_seconds for lane in stats.lanes}
    lanes = tuple(
        DeviceLane(
            lane, span_busy.get(lane, 0.0), device[lane] / 1e6, gaps[lane] / 1e6, stats.makespan_seconds
        )
        for lane in sorted(set(device) | {lane for lane in span_busy if lane.startswith("gpu")})
    )
    bound = _launch_bound(gpu, kernels)
    top = tuple(sorted(bound, key=lambda b: -b.wasted_us)[:TOP])
    return DeviceStats(lanes, top, len(bound), len(gpu))


def _by_lane(
    spans: Sequence[SpanRecord], kernels: Sequence[KernelRecord]
) -> dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]]:
    """Each lane's span and kernel intervals."""
    out: dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = defaultdict(
        lambda: ([], [])
    )
    for r in spans:
        out[r.lane][0].append((r.start, r.end))
    for k in kernels:
        if k.lane is not None:
            out[k.lane][1].append((k.start, k.end))
    return out


def _launch_bound(gpu: Sequence[SpanRecord], kernels: Sequence[KernelRecord]) -> list[LaunchBound]:
    """The GPU nodes whose span is at least LAUNCH_BOUND times their kernels' busy time."""
    of_node: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for k in kernels:
        if k.node is not None:
            of_node[k.node].append((k.start, k.end))
    nodes = (
        LaunchBound(r.id, r.label, r.lane, r.end - r.start, union_us(of_node.get(r.id, []))) for r in gpu
    )
    return [n for n in nodes if n.span_us > 0 and n.span_us >= LAUNCH_BOUND * n.kernel_us]
