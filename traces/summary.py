"""Trace analysis: the run statistics (traces/stats.py) of each trace group, and the critical path.

Works on the Chrome JSON flowmoe writes, and on any Chrome trace (events without a pid or tid
fall in process 0, thread 0), so a saved trace can be summarised; a comparison trace gives one
summary per scheduler (process group).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from attrs import frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.traces.stats import LaneStats, RunStats, SpanRecord, Window, run_stats

STEPS_EVENT = "flowmoe_steps"  # metadata event: a trace group's step windows


@frozen
class TraceSummary:
    group: str
    stats: RunStats
    critical_path: tuple[SpanRecord, ...]

    @property
    def makespan_us(self) -> float:
        return self.stats.makespan_seconds * 1e6

    @property
    def lanes(self) -> tuple[LaneStats, ...]:
        return self.stats.lanes

    @property
    def busiest(self) -> LaneStats | None:
        return self.stats.busiest

    def critical_by_op(self) -> dict[str, float]:
        """Microseconds of the critical path spent in each op."""
        out: dict[str, float] = defaultdict(float)
        for record in self.critical_path:
            out[record.op] += record.end - record.start
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _events(data: dict[str, Any]) -> list[dict[str, Any]]:
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise FlowmoeError("traceEvents is not a list of events")
    return [e for e in events if isinstance(e, dict)]


def _group(names: dict[Any, str], pid: Any) -> str:
    process = names.get(pid, "flowmoe")
    return process.split(": ", 1)[0] if ": " in process else "run"


def _number(event: dict[str, Any], key: str, index: int) -> float:
    value = event.get(key, 0.0 if key == "dur" else None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FlowmoeError(f"event {index} ({event.get('name', '?')}): {key} is not a number")
    return float(value)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def records_by_group(data: dict[str, Any]) -> dict[str, list[SpanRecord]]:
    """X events grouped by trace group (the part of the process name before ': ')."""
    events = _events(data)
    names = {
        e.get("pid", 0): str(e.get("args", {}).get("name")) for e in events if e.get("name") == "process_name"
    }
    threads = {
        (e.get("pid", 0), e.get("tid", 0)): str(e.get("args", {}).get("name"))
        for e in events
        if e.get("name") == "thread_name"
    }
    groups: dict[str, list[SpanRecord]] = defaultdict(list)
    for index, event in enumerate(events):
        if event.get("ph") != "X":
            continue
        pid, tid = event.get("pid", 0), event.get("tid", 0)
        group = _group(names, pid)
        raw_args = event.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        start, dur = _number(event, "ts", index), _number(event, "dur", index)
        deps = args.get("deps", ())
        groups[group].append(
            SpanRecord(
                id=_int(args.get("id"), -1 - len(groups[group])),
                lane=threads.get((pid, tid), str(tid)),
                op=str(args.get("op", event.get("cat", ""))),
                label=str(event.get("name", "")),
                start=start,
                end=start + dur,
                queued=float(args.get("queued_us", start))
                if isinstance(args.get("queued_us"), int | float)
                else start,
                deps=tuple(d for d in deps if isinstance(d, int)) if isinstance(deps, list) else (),
                layer=_int(args.get("layer"), -1),
                expert=_int(args.get("expert"), -1),
                nbytes=_int(args.get("bytes"), 0),
            )
        )
    return dict(groups)


def windows_by_group(data: dict[str, Any]) -> dict[str, list[Window]]:
    """The step windows flowmoe wrote for each trace group (none for other traces)."""
    events = _events(data)
    names = {
        e.get("pid", 0): str(e.get("args", {}).get("name")) for e in events if e.get("name") == "process_name"
    }
    out: dict[str, list[Window]] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == STEPS_EVENT:
            try:
                out[_group(names, event.get("pid", 0))] = [_window(s) for s in event["args"]["steps"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise FlowmoeError(f"{STEPS_EVENT} event: malformed step windows ({exc!r})") from exc
    return out


def _window(step: dict[str, Any]) -> Window:
    host = step.get("host_us")
    return Window(float(step["start_us"]), float(step["end_us"]), float(step.get("weight", 1.0)),
                  None if host is None else float(host))  # fmt: skip


def summarize(data: dict[str, Any]) -> list[TraceSummary]:
    windows = windows_by_group(data)
    return [
        summarize_records(group, records, windows.get(group, ()))
        for group, records in records_by_group(data).items()
    ]


def summarize_records(
    group: str, records: list[SpanRecord], windows: list[Window] | tuple = ()
) -> TraceSummary:
    if not records:
        return TraceSummary(group, run_stats([], windows), ())
    by_lane: dict[str, list[SpanRecord]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r.start):
        by_lane[record.lane].append(record)
    return TraceSummary(group, run_stats(records, windows), critical_path(records, by_lane))


def critical_path(records: list[SpanRecord], by_lane: dict[str, list[SpanRecord]]) -> tuple[SpanRecord, ...]:
    """Walk back from the last node to finish, each time to whatever released it last:
    a dependency, or the node ahead of it on its lane."""
    by_id = {r.id: r for r in records}
    lane_prev: dict[int, SpanRecord] = {}
    for spans in by_lane.values():
        for prev, nxt in itertools.pairwise(spans):
            lane_prev[nxt.id] = prev
    path = [max(records, key=lambda r: r.end)]
    seen = {path[0].id}
    while True:
        current = path[-1]
        before = [by_id[d] for d in current.deps if d in by_id]
        if current.id in lane_prev:
            before.append(lane_prev[current.id])
        before = [r for r in before if r.id not in seen]
        if not before:
            break
        path.append(max(before, key=lambda r: r.end))
        seen.add(path[-1].id)
    return tuple(reversed(path))
