"""A run's statistics, with one definition for every place that reports them (`run`, `simulate`,
`compare`, `trace summarize`): they are computed from span records and step windows only, so a
saved trace gives the same figures as the run that wrote it.

Per step window (weighted by how many steps it stands for, 1 in a real run):
- makespan: the window's length; a run's makespan is the weighted sum over its windows;
- a lane's busy time: the union of its spans' intervals inside the window; its busy share is
  busy time / makespan; bytes: what its nodes moved (or read, for compute);
- bubbles: time a lane sat idle while its next node was already queued (waiting on dependencies);
- overlap: makespan / the busiest lane's busy time (1.0: the busiest lane never waited);
- expert-cache hit rate: of the distinct (layer, expert) pairs an expert FFN used in the step,
  the share that ran on the GPU without a PAGE_COPY bringing them in during that step;
- prefetch accuracy: of the distinct (layer, expert) pairs copied to the GPU in the step, the
  share an expert FFN then used on the GPU in the same step;
- host time per step: the host's CPU time per step where it was measured (a run: the process's,
  tensor math on host threads included; the real-clock simulation: its lane threads' and event
  loop's, waits excluded; the virtual-clock simulation has none).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from attrs import frozen

PAGE_COPY, EXPERT_FFN = "page_copy", "expert_ffn"


@frozen
class SpanRecord:
    id: int
    lane: str
    op: str
    label: str
    start: float  # microseconds
    end: float
    queued: float
    deps: tuple[int, ...]
    layer: int = -1
    expert: int = -1
    nbytes: int = 0
    launch: float | None = None  # microseconds of host time in its launch (a device-timed span)


@frozen
class Window:
    """A step on the records' clock (microseconds), the steps it stands for, its host CPU time."""

    start: float
    end: float
    weight: float = 1.0
    host_us: float | None = None


@frozen
class LaneStats:
    lane: str
    nodes: float  # weighted, as every figure here
    bytes: float
    busy_seconds: float  # union of the lane's intervals
    share: float  # busy / makespan
    bubble_seconds: float
    launch_seconds: float | None = None  # host time in its nodes' launches, where the spans are the device's

    @property
    def busy_us(self) -> float:
        return self.busy_seconds * 1e6

    @property
    def bubble_us(self) -> float:
        return self.bubble_seconds * 1e6

    @property
    def utilisation(self) -> float:
        return self.share

    def to_json(self) -> dict:
        return {"lane": self.lane, "nodes": self.nodes, "bytes": self.bytes,
                "busy_seconds": self.busy_seconds,
                "busy_share": self.share, "bubble_seconds": self.bubble_seconds,
                "launch_seconds": self.launch_seconds}  # fmt: skip


@frozen
class RunStats:
    makespan_seconds: float
    steps: float  # weighted step count
    lanes: tuple[LaneStats, ...]
    expert_cache_hit_rate: float | None
    prefetch_accuracy: float | None
    host_seconds_per_step: float | None

    @property
    def busiest(self) -> LaneStats | None:
        return max(self.lanes, key=lambda lane: lane.busy_seconds, default=None)

    @property
    def overlap(self) -> float:
        """Makespan over the busiest lane's busy time."""
        busiest = self.busiest
        return self.makespan_seconds / busiest.busy_seconds if busiest and busiest.busy_seconds else 0.0

    def to_json(self) -> dict:
        return {
            "makespan_seconds": self.makespan_seconds, "steps": self.steps, "overlap": self.overlap,
            "expert_cache_hit_rate": self.expert_cache_hit_rate, "prefetch_accuracy": self.prefetch_accuracy,
            "host_seconds_per_step": self.host_seconds_per_step,
            "lanes": [lane.to_json() for lane in self.lanes],
        }  # fmt: skip


def union_us(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _bubbles_us(spans: Sequence[SpanRecord]) -> float:
    ordered = sorted(spans, key=lambda r: r.start)
    reach, total = float("-inf"), 0.0
    for record in ordered:
        if reach > float("-inf"):
            total += max(0.0, record.start - max(reach, record.queued))
        reach = max(reach, record.end)
    return total


class Timed(Protocol):
    @property
    def start(self) -> float: ...


T = TypeVar("T", bound=Timed)


def split(records: Sequence[T], windows: Sequence[Window]) -> list[list[T]]:
    """Each record into the last window starting at or before it (the first, for earlier ones)."""
    starts = [w.start for w in windows]
    parts: list[list[T]] = [[] for _ in windows]
    for record in records:
        parts[max(0, bisect.bisect_right(starts, record.start) - 1)].append(record)
    return parts


def run_stats(records: Sequence[SpanRecord], windows: Sequence[Window] = ()) -> RunStats:
    """The statistics of `records`; without windows the whole trace is one step."""
    if not windows:
        if not records:
            return RunStats(0.0, 0.0, (), None, None, None)
        windows = [Window(min(r.start for r in records), max(r.end for r in records))]
    windows = sorted(windows, key=lambda w: w.start)
    makespan = steps = 0.0
    # per lane: nodes, bytes, busy, bubble, launch (summed where its spans carry launch times: `launched`)
    lanes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    launched: set[str] = set()
    hits = used = prefetched = copied = 0.0
    host, hosted = 0.0, 0.0
    for window, part in zip(windows, split(records, windows), strict=True):
        w = window.weight
        makespan += w * (window.end - window.start)
        steps += w
        if window.host_us is not None:
            host, hosted = host + w * window.host_us, hosted + w
        by_lane: dict[str, list[SpanRecord]] = defaultdict(list)
        for record in part:
            by_lane[record.lane].append(record)
        for lane, spans in by_lane.items():
            total = lanes[lane]
            total[0] += w * len(spans)
            total[1] += w * sum(r.nbytes for r in spans)
            total[2] += w * union_us([(r.start, r.end) for r in spans])
            total[3] += w * _bubbles_us(spans)
            launches = [r.launch for r in spans if r.launch is not None]
            if launches:
                total[4] += w * sum(launches)
                launched.add(lane)
        h, u, p, c = _expert_counts(part)
        hits, used, prefetched, copied = hits + w * h, used + w * u, prefetched + w * p, copied + w * c
    seconds = makespan / 1e6
    lane_stats = tuple(
        LaneStats(
            lane,
            t[0],
            t[1],
            t[2] / 1e6,
            t[2] / makespan if makespan else 0.0,
            t[3] / 1e6,
            t[4] / 1e6 if lane in launched else None,
        )
        for lane, t in sorted(lanes.items())
    )
    return RunStats(
        seconds, steps, lane_stats, hits / used if used else None, prefetched / copied if copied else None,
        host / hosted / 1e6 if hosted else None,
    )  # fmt: skip


def _expert_counts(records: Sequence[SpanRecord]) -> tuple[int, int, int, int]:
    """(hits, experts used, copied experts used, experts copied) of one step."""
    copied = {(r.layer, r.expert) for r in records if r.op == PAGE_COPY and r.expert >= 0}
    used: dict[tuple[int, int], bool] = {}  # (layer, expert) -> ran on the GPU
    for r in records:
        if r.op == EXPERT_FFN:
            key = (r.layer, r.expert)
            used[key] = used.get(key, False) or r.lane.startswith("gpu")
    hits = sum(1 for key, on_gpu in used.items() if on_gpu and key not in copied)
    prefetched = sum(1 for key in copied if used.get(key, False))
    return hits, len(used), prefetched, len(copied)
