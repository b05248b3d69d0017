"""What a workload simulation reports: throughput, phase times, per-lane busy time, bubbles, memory.

Per-lane figures of the simulated decode steps are interpolated over every
decode step the same way the step times are, so they add up to the whole
batch's prefill + decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attrs import frozen

from flowmoe.core.executor import Span
from flowmoe.core.memory import MemoryNeed
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import StepShape
from flowmoe.traces.summary import SpanRecord, summarize_records
from flowmoe.traces.trace import Trace


@frozen
class StepRun:
    step: StepShape
    start: float
    end: float
    spans: tuple[Span, ...]

    @property
    def seconds(self) -> float:
        return self.end - self.start


@frozen
class LaneTotal:
    lane: str
    busy_seconds: float
    bubble_seconds: float  # idle while its next node was queued, waiting on dependencies


@frozen
class SimulationResult:
    scheduler: str
    policy: Policy
    sequences: int
    prompt_tokens: int
    generated: int
    memory: MemoryNeed
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    lanes: tuple[LaneTotal, ...] = ()
    trace: Trace | None = None
    simulated_steps: int = 0
    error: str | None = None  # why it could not run (memory), instead of figures

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def throughput(self) -> float:
        """Generated tokens / (prefill + decode) seconds."""
        return self.generated / self.seconds if self.seconds and self.error is None else 0.0

    def utilisation(self, lane: LaneTotal) -> float:
        return lane.busy_seconds / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        p = self.policy
        policy = {"batch_size": p.batch_size, "micro_batch_size": p.micro_batch_size,
                  "micro_batches": p.micro_batches, "attention_on": p.attention_on, "ffn_on": p.ffn_on,
                  "weights_gpu_share": p.weights_gpu_share, "kv_gpu_share": p.kv_gpu_share}  # fmt: skip
        lanes = [
            {"lane": lane.lane, "busy_seconds": lane.busy_seconds, "utilisation": self.utilisation(lane),
             "bubble_seconds": lane.bubble_seconds}
            for lane in self.lanes
        ]  # fmt: skip
        return {
            "scheduler": self.scheduler, "error": self.error, "policy": policy, "sequences": self.sequences,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated,
            "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
            "throughput_tokens_per_second": self.throughput, "simulated_steps": self.simulated_steps,
            "gpu_memory_bytes": self.memory.total, "lanes": lanes,
        }  # fmt: skip


def records(spans: Sequence[Span]) -> list[SpanRecord]:
    """Spans as the trace analysis reads them (microseconds)."""
    return [
        SpanRecord(
            s.node.id,
            str(s.node.lane),
            str(s.node.op),
            s.node.label,
            s.start * 1e6,
            s.end * 1e6,
            s.queued * 1e6,
            s.node.deps,
        )
        for s in spans
    ]


def _per_lane(run: StepRun) -> dict[str, tuple[float, float]]:
    """lane -> (busy seconds, bubble seconds) of one step."""
    summary = summarize_records("step", records(run.spans))
    return {lane.lane: (lane.busy_us / 1e6, lane.bubble_us / 1e6) for lane in summary.lanes}


def lane_totals(
    prefill: StepRun, decode: Sequence[StepRun], at: Sequence[int], count: int
) -> tuple[LaneTotal, ...]:
    first = _per_lane(prefill)
    per_step = [_per_lane(run) for run in decode]
    lanes = sorted(set(first).union(*per_step))
    out = []
    for lane in lanes:
        busy = [step.get(lane, (0.0, 0.0))[0] for step in per_step]
        idle = [step.get(lane, (0.0, 0.0))[1] for step in per_step]
        head = first.get(lane, (0.0, 0.0))
        out.append(
            LaneTotal(lane, head[0] + interpolate(busy, at, count), head[1] + interpolate(idle, at, count))
        )
    return tuple(out)


def interpolate(values: Sequence[float], at: Sequence[int], count: int) -> float:
    """Sum over 0..count-1 of the piecewise-linear interpolation of `values` known at ascending `at`."""
    if not values:
        return 0.0
    total = 0.0
    for i in range(count):
        right = next((k for k, a in enumerate(at) if a >= i), len(at) - 1)
        left = right - 1 if at[right] > i and right > 0 else right
        if at[right] == at[left]:
            total += values[right]
        else:
            w = (i - at[left]) / (at[right] - at[left])
            total += values[left] * (1 - w) + values[right] * w
    return total
