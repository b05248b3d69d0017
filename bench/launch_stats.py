"""Per-event host costs of a CUDA run, read from its Chrome trace (issue 29, item 4).

A CUDA run's gpu.compute span runs from the begin event to the end event its launch thread records
around the node's action (devices/cuda.py), both dated on the GPU. For a node whose kernels take
microseconds (the dense per-layer nodes at decode), the device idles while the host launches, so
the span is the launch thread's time in the action and the gap to the next span is its time between
two actions. This module measures, over a trace's decode steps (every step window after the first,
the prefill):

- `node_gap_us`: the median gap between back-to-back gpu.compute spans where the device waited for the
  host (the next node was queued before the previous ended, and every producer of it on another lane
  had ended by then) and the next node is a dense kind with no producer on another lane: what the
  launch thread does per node outside the action (the executor's hand-off of the previous node, the
  next node taken off the lane's queue, two events taken from the pool and recorded);
- `wait_gap_us`: the same median for nodes with one producer on another lane (an expert FFN after its
  page copies: `stream.wait_event` once more), minus `node_gap_us`;
- `evict_span_us`: the median EVICT span (its bookkeeping and `record_stream` on each tensor);
- `readback_us`: the median time from a gate's end to the first expert FFN that consumes it being
  queued: the routing read-back (event wait, `.tolist()`, slicing the rows by expert), the scheduler
  planning the layer's experts, the driver submitting the first of them.

The same functions read a real-clock run's trace (`flowmoe simulate --realtime`), so the part of an
interval the real clock runs for real can be measured the same way and left out of a charge.
"""

from __future__ import annotations

import gzip
import itertools
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from attrs import asdict, frozen

from flowmoe.core.bounded_read import TRACE, open_regular
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.jsonfile import JsonProblem, parse_json
from flowmoe.traces.stats import SpanRecord, split
from flowmoe.traces.summary import records_by_group, windows_by_group

H200_TRACE = Path(__file__).parents[2] / "shared/gpu-runs/2026-11-27-h200/t4-cgopipe-trace.json.gz"
COMPUTE = "gpu.compute"
# kinds whose kernels take microseconds at decode (launch-bound): their gaps are the launch thread's
DENSE = frozenset({"pre_attn", "gpu_attn", "post_attn", "gate", "combine", "lm_head"})
# kinds whose own host work fills the gap after them (evict: see `evict_span_us`; embed: the step's start)
NOT_BEFORE = frozenset({"evict", "embed"})


def read_trace_gz(path: Path, limit: int = TRACE.limit) -> dict[str, Any]:
    """The gzipped Chrome trace at `path`, decompressed up to `limit` bytes (a larger one is refused)."""
    with open_regular(path, FlowmoeError) as handle, gzip.GzipFile(fileobj=handle) as text:
        data = text.read(limit + 1)
    if len(data) > limit:
        raise FlowmoeError(f"{path}: more than {limit} bytes decompressed ({TRACE.kind}'s bound); not read")
    try:
        parsed = parse_json(data.decode("utf-8"))
    except (UnicodeDecodeError, JsonProblem) as exc:
        raise FlowmoeError(f"{path}: {exc}") from exc
    if not isinstance(parsed, dict):
        raise FlowmoeError(f"{path}: not a Chrome trace object")
    return parsed


def trace_steps(data: dict[str, Any], decode_only: bool = True) -> list[list[SpanRecord]]:
    """The span records of each step window of the trace's first group; `decode_only`: all but the
    first window (a run's prefill; a real-clock run's trace holds decode steps only)."""
    records, windows = records_by_group(data), windows_by_group(data)
    group = next(iter(records))
    return split(records[group], windows.get(group, []))[1 if decode_only else 0 :]


@frozen
class Gap:
    """The launch thread's time between two back-to-back gpu.compute spans, the device waiting."""

    before: str  # the previous node's kind
    after: str  # the next node's kind
    waits: int  # the next node's producers on another lane (each a `stream.wait_event`)
    us: float


def compute_gaps(step: Sequence[SpanRecord]) -> list[Gap]:
    """The gaps of one step's gpu.compute lane where the device waited for the host: the next node
    was queued, and its producers on other lanes had ended, before the previous node ended."""
    by_id = {r.id: r for r in step}
    lane = sorted((r for r in step if r.lane == COMPUTE), key=lambda r: r.start)
    gaps = []
    for prev, node in itertools.pairwise(lane):
        others = [by_id[d] for d in node.deps if d in by_id and by_id[d].lane != COMPUTE]
        if node.queued <= prev.end and all(p.end <= prev.end for p in others):
            gaps.append(Gap(prev.op, node.op, len(others), node.start - prev.end))
    return gaps


def readbacks(step: Sequence[SpanRecord]) -> list[float]:
    """For each gate: microseconds from its end to the first expert FFN consuming it being queued."""
    gates = {r.id: r for r in step if r.op == "gate"}
    first: dict[int, float] = {}
    for r in step:
        for dep in r.deps:
            if r.op == "expert_ffn" and dep in gates:
                first[dep] = min(first.get(dep, r.queued), r.queued)
    return [queued - gates[gate].end for gate, queued in first.items()]


def readback_us(steps: Sequence[Sequence[SpanRecord]]) -> list[float]:
    """`readbacks` of every step."""
    return [us for step in steps for us in readbacks(step)]


@frozen
class LaunchStats:
    """The per-event statistics of a trace (microseconds, medians over its decode steps) and how
    many events each stands on."""

    node_gap_us: float
    node_gaps: int
    wait_gap_us: float
    wait_gaps: int
    evict_span_us: float
    evicts_per_step: float
    readback_us: float
    readbacks_per_step: float

    @classmethod
    def of(cls, steps: Sequence[Sequence[SpanRecord]]) -> LaunchStats:
        gaps = [g for step in steps for g in compute_gaps(step) if g.before not in NOT_BEFORE]
        # after an expert FFN the device may still be busy (its kernels read the expert from HBM)
        none = [g.us for g in gaps if g.after in DENSE and g.before != "expert_ffn" and g.waits == 0]
        one = [g.us for g in gaps if g.after == "expert_ffn" and g.waits == 1]
        evicts = [r.end - r.start for step in steps for r in step if r.op == "evict"]
        reads = readback_us(steps)
        node = median(none)
        return cls(node, len(none), median(one) - node, len(one), median(evicts), len(evicts) / len(steps),
                   median(reads), len(reads) / len(steps))  # fmt: skip

    def to_json(self) -> dict[str, float]:
        return asdict(self)
