"""Trace analysis: per-lane busy time and utilisation, bubbles, makespan and the critical path.

Works on the Chrome JSON flowmoe writes, so any saved trace can be summarised;
a comparison trace gives one summary per scheduler (process group).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from attrs import frozen


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


@frozen
class LaneStats:
    lane: str
    nodes: int
    busy_us: float
    utilisation: float  # busy / makespan
    bubble_us: float  # idle while its next node was already queued (waiting on dependencies)


@frozen
class TraceSummary:
    group: str
    makespan_us: float
    lanes: tuple[LaneStats, ...]
    critical_path: tuple[SpanRecord, ...]

    @property
    def busiest(self) -> LaneStats:
        return max(self.lanes, key=lambda lane: lane.busy_us)

    def critical_by_op(self) -> dict[str, float]:
        """Microseconds of the critical path spent in each op."""
        out: dict[str, float] = defaultdict(float)
        for record in self.critical_path:
            out[record.op] += record.end - record.start
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def records_by_group(data: dict[str, Any]) -> dict[str, list[SpanRecord]]:
    """X events grouped by trace group (the part of the process name before ': ')."""
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"
    }
    groups: dict[str, list[SpanRecord]] = defaultdict(list)
    for event in data["traceEvents"]:
        if event.get("ph") != "X":
            continue
        process = names.get(event["pid"], "flowmoe")
        group = process.split(": ", 1)[0] if ": " in process else "run"
        args = event.get("args", {})
        groups[group].append(
            SpanRecord(
                id=int(args.get("id", len(groups[group]))),
                lane=threads.get((event["pid"], event["tid"]), str(event["tid"])),
                op=str(args.get("op", event.get("cat", ""))),
                label=event["name"],
                start=float(event["ts"]),
                end=float(event["ts"]) + float(event["dur"]),
                queued=float(args.get("queued_us", event["ts"])),
                deps=tuple(args.get("deps", ())),
            )
        )
    return dict(groups)


def summarize(data: dict[str, Any]) -> list[TraceSummary]:
    return [summarize_records(group, records) for group, records in records_by_group(data).items()]


def summarize_records(group: str, records: list[SpanRecord]) -> TraceSummary:
    if not records:
        return TraceSummary(group, 0.0, (), ())
    origin = min(r.start for r in records)
    makespan = max(r.end for r in records) - origin
    by_lane: dict[str, list[SpanRecord]] = defaultdict(list)
    for record in records:
        by_lane[record.lane].append(record)
    lanes = []
    for lane, spans in sorted(by_lane.items()):
        spans.sort(key=lambda r: r.start)
        busy = sum(r.end - r.start for r in spans)
        bubble = sum(
            max(0.0, nxt.start - max(prev.end, nxt.queued)) for prev, nxt in itertools.pairwise(spans)
        )
        lanes.append(LaneStats(lane, len(spans), busy, busy / makespan if makespan else 0.0, bubble))
    return TraceSummary(group, makespan, tuple(lanes), critical_path(records, by_lane))


def critical_path(records: list[SpanRecord], by_lane: dict[str, list[SpanRecord]]) -> tuple[SpanRecord, ...]:
    """Walk back from the last node to finish, each time to whatever released it last:
    a dependency, or the node ahead of it on its lane."""
    by_id = {r.id: r for r in records}
    lane_prev: dict[int, SpanRecord] = {}
    for spans in by_lane.values():
        for prev, nxt in itertools.pairwise(spans):
            lane_prev[nxt.id] = prev
    path = [max(records, key=lambda r: r.end)]
    while True:
        current = path[-1]
        before = [by_id[d] for d in current.deps if d in by_id]
        if current.id in lane_prev:
            before.append(lane_prev[current.id])
        if not before:
            break
        path.append(max(before, key=lambda r: r.end))
    return tuple(reversed(path))
