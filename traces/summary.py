"""Trace analysis: the run statistics (traces/stats.py) of each trace group, the critical path and,
where the trace holds kernel tracks (--trace-kernels), what the device did (traces/device_stats.py).

Works on the Chrome JSON flowmoe writes, and on any Chrome trace (events without a pid or tid
fall in process 0, thread 0), so a saved trace can be summarised; a comparison trace gives one
summary per scheduler (process group).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

from attrs import frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.traces.device_stats import DeviceStats, KernelRecord, device_stats
from flowmoe.traces.stats import LaneStats, RunStats, SpanRecord, Window, run_stats

STEPS_EVENT = "flowmoe_steps"  # metadata event: a trace group's step windows
KERNEL_CAT = "device"  # the category of a kernel track's slices (not nodes: what the device ran)


@frozen
class TraceSummary:
    group: str
    stats: RunStats
    critical_path: tuple[SpanRecord, ...]
    device: DeviceStats | None = None  # where the trace holds kernel tracks

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
    """A time of an event: a finite number (microseconds), a duration not negative; anything else
    would print negative, NaN or infinite busy times, so it is an error naming the event."""
    value = event.get(key, 0.0 if key == "dur" else None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FlowmoeError(f"event {index} ({_name_of(event)}): {key} is not a number")
    number = _finite(value)
    if number is None or (key == "dur" and number < 0):
        what = "a negative duration" if number is not None else "not a finite number"
        raise FlowmoeError(f"event {index} ({_name_of(event)}): {key} {_shown(value)} is {what}")
    return number


def _finite(value: Any) -> float | None:
    """`value` as a finite float (ints past float's range are not), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _name_of(event: dict[str, Any]) -> str:
    """An event's name as an error line shows it (at most 40 characters)."""
    name = event.get("name", "?")
    return _shown(name) if not isinstance(name, str) else name if len(name) <= 40 else name[:37] + "..."


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(event: dict[str, Any], field: str, index: int) -> int | str:
    """An event's pid or tid: a number or a string (0 when absent), never a list or an object."""
    value = event.get(field, 0)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise FlowmoeError(
            f"event {index} ({_name_of(event)}): {field} {_shown(value)} is not a number or a string"
        )
    return value


def _meta_name(event: dict[str, Any], index: int) -> str:
    """The name a process_name or thread_name event gives: args must be an object with a name."""
    args = event.get("args")
    if not isinstance(args, dict) or not isinstance(args.get("name"), str | int | float):
        raise FlowmoeError(f'event {index} ({event.get("name")}): args must be an object with a "name"')
    return str(args["name"])


def _names(events: list[dict[str, Any]]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    """Process names by pid and thread names by (pid, tid), from the metadata events."""
    names: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for index, e in enumerate(events):
        if e.get("name") == "process_name":
            names[_key(e, "pid", index)] = _meta_name(e, index)
        elif e.get("name") == "thread_name":
            threads[(_key(e, "pid", index), _key(e, "tid", index))] = _meta_name(e, index)
    return names, threads


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def records_by_group(data: dict[str, Any]) -> dict[str, list[SpanRecord]]:
    """X events grouped by trace group (the part of the process name before ': ')."""
    events = _events(data)
    names, threads = _names(events)
    groups: dict[str, list[SpanRecord]] = defaultdict(list)
    for index, event in enumerate(events):
        if event.get("ph") != "X" or event.get("cat") == KERNEL_CAT:
            continue
        pid, tid = _key(event, "pid", index), _key(event, "tid", index)
        group = _group(names, pid)
        raw_args = event.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        start, dur = _number(event, "ts", index), _number(event, "dur", index)
        if not math.isfinite(start + dur):
            raise FlowmoeError(f"event {index} ({_name_of(event)}): ts + dur is not a finite time")
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
                launch=_finite(args.get("launch_us")),
            )
        )
    return dict(groups)


def kernels_by_group(data: dict[str, Any]) -> dict[str, list[KernelRecord]]:
    """The slices of the kernel tracks (category KERNEL_CAT), by trace group."""
    events = _events(data)
    names, _threads = _names(events)
    groups: dict[str, list[KernelRecord]] = defaultdict(list)
    for index, event in enumerate(events):
        if event.get("ph") != "X" or event.get("cat") != KERNEL_CAT:
            continue
        raw_args = event.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        lane, node = args.get("lane"), args.get("node")
        start, dur = _number(event, "ts", index), _number(event, "dur", index)
        groups[_group(names, _key(event, "pid", index))].append(
            KernelRecord(
                None if lane is None else str(lane),
                node if isinstance(node, int) else None,
                start,
                start + dur,
            )
        )
    return dict(groups)


def windows_by_group(data: dict[str, Any]) -> dict[str, list[Window]]:
    """The step windows flowmoe wrote for each trace group (none for other traces)."""
    events = _events(data)
    names, _threads = _names(events)
    out: dict[str, list[Window]] = {}
    for index, event in enumerate(events):
        if event.get("ph") == "M" and event.get("name") == STEPS_EVENT:
            try:
                out[_group(names, _key(event, "pid", index))] = [_window(s) for s in event["args"]["steps"]]
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise FlowmoeError(f"{STEPS_EVENT} event: malformed step windows ({exc!r})") from exc
    return out


def _window(step: dict[str, Any]) -> Window:
    """One step window: finite times, its end not before its start, weight and host time >= 0."""
    host = step.get("host_us")
    window = Window(float(step["start_us"]), float(step["end_us"]), float(step.get("weight", 1.0)),
                    None if host is None else float(host))  # fmt: skip
    numbers = (window.start, window.end, window.weight, 0.0 if window.host_us is None else window.host_us)
    if (
        not all(map(math.isfinite, numbers))
        or window.end < window.start
        or window.weight < 0
        or (window.host_us is not None and window.host_us < 0)
    ):
        raise ValueError(f"step {step!r:.80} is not a window of finite times, end >= start, weight >= 0")
    return window


def summarize(data: dict[str, Any]) -> list[TraceSummary]:
    """One summary per trace group; a trace without a single complete ("X") event is an error, not
    a table of nothing."""
    windows = windows_by_group(data)
    records = records_by_group(data)
    kernels = kernels_by_group(data)
    if not records:
        raise FlowmoeError('no complete ("ph": "X") events to summarise')
    return [
        summarize_records(group, records, windows.get(group, ()), kernels.get(group))
        for group, records in records.items()
    ]


def summarize_records(
    group: str,
    records: list[SpanRecord],
    windows: list[Window] | tuple = (),
    kernels: list[KernelRecord] | None = None,
) -> TraceSummary:
    """`kernels`: the group's kernel tracks, where the trace holds them."""
    if not records:
        return TraceSummary(group, run_stats([], windows), ())
    by_lane: dict[str, list[SpanRecord]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r.start):
        by_lane[record.lane].append(record)
    stats = run_stats(records, windows)
    device = device_stats(stats, records, kernels, windows) if kernels else None
    return TraceSummary(group, stats, critical_path(records, by_lane), device)


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
