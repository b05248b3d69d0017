"""Chrome Trace Event JSON (opens in Perfetto and chrome://tracing).

A process per device (per scheduler in a comparison), a named thread per lane,
an `X` event per node with its args, flow arrows for cross-lane dependencies,
and `C` counter tracks. With --trace-kernels, a thread under each GPU lane per stream it ran on,
holding the kernels and copies that really ran there (category "device"; args: the node that
launched each, its lane and stream).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from flowmoe.core.plan import Lane
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard, OutputKind
from flowmoe.traces.summary import KERNEL_CAT, STEPS_EVENT
from flowmoe.traces.trace import KernelSlice, Trace

DEVICES = ("gpu", "cpu", "disk")
EMULATED = "emulated on the CPU"  # the gpu process's label (Perfetto shows it) when there was no GPU
WRITER = {"writer": "flowmoe"}  # the trace's otherData, written first: the mark of a trace flowmoe wrote
CHROME_TRACE = OutputKind("Chrome trace", f'{{"otherData": {json.dumps(WRITER)}'.encode())
LANES = tuple(Lane)


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(ns: int) -> float:
    """Integer nanoseconds as microseconds: ts and ts + dur land on whole nanoseconds, so
    consecutive slices of a lane never overlap by a rounding error."""
    return ns / 1000


def chrome_trace(traces: list[Trace]) -> dict[str, Any]:
    """One process group per trace (stacked in Perfetto), all on one time origin."""
    origin = min((t.origin for t in traces if t.spans or t.counters or t.steps), default=0.0)

    def at(seconds: float) -> float:
        return _us(_ns(seconds - origin))

    events: list[dict[str, Any]] = []
    flow_id = 0
    for group, trace in enumerate(traces):
        prefix = f"{trace.name}: " if len(traces) > 1 else ""
        pid_of = {device: 1 + group * len(DEVICES) + i for i, device in enumerate(DEVICES)}
        for device, pid in pid_of.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{prefix}{device}"}})  # fmt: skip
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
            if device == "gpu" and trace.gpu_emulated:
                events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                               "args": {"labels": EMULATED}})  # fmt: skip
        for lane in LANES:
            events.append({"ph": "M", "name": "thread_name", "pid": pid_of[lane.device], "tid": _tid(lane),
                           "args": {"name": str(lane)}})  # fmt: skip
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid_of[lane.device],
                           "tid": _tid(lane), "args": {"sort_index": _SORT * _tid(lane)}})  # fmt: skip
        tracks = _kernel_tracks(trace.kernels)
        for tid, sort_index, name in tracks.values():
            events.append({"ph": "M", "name": "thread_name", "pid": pid_of["gpu"], "tid": tid,
                           "args": {"name": name}})  # fmt: skip
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid_of["gpu"], "tid": tid,
                           "args": {"sort_index": sort_index}})  # fmt: skip
        for kernel in trace.kernels:
            start, end = _ns(kernel.start - origin), _ns(kernel.end - origin)
            kernel_args = {"kind": kernel.kind, "lane": None if kernel.lane is None else str(kernel.lane),
                           "node": kernel.node, "stream": kernel.stream}  # fmt: skip
            events.append({"name": kernel.name, "cat": KERNEL_CAT, "ph": "X", "ts": _us(start),
                           "dur": _us(end - start), "pid": pid_of["gpu"],
                           "tid": tracks[(kernel.lane, kernel.stream)][0], "args": kernel_args})  # fmt: skip
        by_id = {s.node.id: s for s in trace.spans}
        for span in trace.spans:
            node = span.node
            args = {
                "id": node.id, "op": str(node.op), "layer": node.layer, "mb": node.mb, "expert": node.expert,
                "bytes": node.bytes, "flops": node.flops, "deps": list(node.deps),
                "queued_us": at(span.queued),
            }  # fmt: skip
            if span.launch is not None:  # a device-timed span: the host's time in its launch
                args["launch_us"] = span.launch * 1e6
            where: dict[str, float] = {"pid": pid_of[node.lane.device], "tid": _tid(node.lane)}
            start, end = _ns(span.start - origin), _ns(span.end - origin)
            ts, dur = _us(start), _us(end - start)
            events.append({"name": node.label, "cat": str(node.op), "ph": "X", "ts": ts, "dur": dur, **where,
                           "args": args})  # fmt: skip
            for dep in node.deps:
                producer = by_id.get(dep)
                if producer is None or producer.node.lane == node.lane:
                    continue
                flow_id += 1
                source = {"pid": pid_of[producer.node.lane.device], "tid": _tid(producer.node.lane)}
                common = {"name": "dep", "cat": "dep", "id": flow_id}
                events.append({**common, "ph": "s", "ts": at(producer.start), **source})
                events.append({**common, "ph": "f", "bp": "e", "ts": at(span.start), **where})
        for sample in trace.counters:
            where = {"pid": pid_of[sample.device], "tid": 0, "ts": at(sample.time)}
            events.append({"ph": "C", "name": sample.name, **where, "args": {"value": sample.value}})
        if trace.steps:
            steps = [
                {
                    "start_us": at(w.start),
                    "end_us": at(w.end),
                    "weight": w.weight,
                    "host_us": None if w.host_seconds is None else w.host_seconds * 1e6,
                }
                for w in trace.steps
            ]
            events.append({"ph": "M", "name": STEPS_EVENT, "pid": pid_of["gpu"], "tid": 0,
                           "args": {"steps": steps}})  # fmt: skip
    return {"otherData": WRITER, "traceEvents": events, "displayTimeUnit": "ms"}


def _tid(lane: Lane) -> int:
    return 1 + LANES.index(lane)


_SORT = 100  # a lane's sort index is _SORT * its tid; its kernel tracks follow it
_KERNEL_TIDS = 100  # the kernel tracks' tids start here, past the lanes'


def _kernel_tracks(kernels: list[KernelSlice]) -> dict[tuple[Lane | None, int], tuple[int, int, str]]:
    """A track per (lane, stream) the kernels ran on: its tid, its sort index (right under its
    lane; streams no node launched on last) and its name."""

    def order(item: tuple[tuple[Lane | None, int], str]) -> tuple[int, int]:
        (lane, stream), _kind = item
        return (_tid(lane) if lane is not None else len(LANES) + 1, stream)

    keys = sorted({(k.lane, k.stream): k.kind for k in kernels}.items(), key=order)
    streams = Counter(lane for (lane, _), _kind in keys)
    tracks = {}
    for i, ((lane, stream), kind) in enumerate(keys):
        what = "ops (CPU)" if kind == "cpu_op" else "kernels"
        if lane is None:
            name, under = f"stream {stream} {what} (no node)", len(LANES) + 1
        else:
            name, under = f"{lane} {what}" + (f" (stream {stream})" if streams[lane] > 1 else ""), _tid(lane)
        tracks[(lane, stream)] = (_KERNEL_TIDS + i, _SORT * under + 1 + i, name)
    return tracks


def write_chrome(path: str | Path, traces: list[Trace], guard: Guard = DEFAULT_GUARD) -> Path:
    """Write through the write guard: whole (a temporary file, then a rename), never over a file
    flowmoe did not write."""
    path = Path(path)
    data = chrome_trace(traces)

    def dump(tmp: Path) -> None:
        with tmp.open("w") as handle:
            json.dump(data, handle)

    return guard.write(path, CHROME_TRACE, dump)


def validate_chrome(data: dict[str, Any]) -> list[str]:
    """Problems with a trace's format: every X has name/ph/ts/dur/pid/tid, every flow both ends."""
    problems = []
    flows: dict[Any, set[str]] = {}
    for i, event in enumerate(data.get("traceEvents", [])):
        ph = event.get("ph")
        if ph == "X":
            missing = [k for k in ("name", "ph", "ts", "dur", "pid", "tid") if k not in event]
            if missing:
                problems.append(f"event {i}: X event without {', '.join(missing)}")
            elif event["dur"] < 0:
                problems.append(f"event {i}: negative duration")
        elif ph in ("s", "f"):
            flows.setdefault(event.get("id"), set()).add(ph)
    problems += [
        f"flow {fid}: only {''.join(sorted(ends))}" for fid, ends in flows.items() if ends != {"s", "f"}
    ]
    return problems
