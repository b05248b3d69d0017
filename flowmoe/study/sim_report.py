"""What a workload simulation reports: throughput, phase times, per-lane busy time, bubbles, memory.

Per-lane figures of the simulated decode steps are interpolated over every
decode step the same way the step times are, so they add up to the whole
batch's prefill + decode.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from attrs import asdict, frozen

from flowmoe.core.executor import Span
from flowmoe.core.memory import MemoryNeed
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import StepShape
from flowmoe.schedulers.registry import load
from flowmoe.traces.device_stats import DeviceStats, KernelRecord, device_stats
from flowmoe.traces.stats import LaneStats, RunStats, SpanRecord, Window, run_stats
from flowmoe.traces.trace import StepWindow, Trace


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
class RealtimeRun:
    """The simulated steps run again on the real clock (`flowmoe simulate --realtime`): the real host
    stack, each device action replaced by waiting its modelled duration."""

    steps: int
    makespan_seconds: float  # the same steps on the virtual clock
    realtime_makespan_seconds: float  # wall clock
    host_seconds: dict[str, float]  # CPU time per lane thread, and "main" (the event loop's thread)
    trace: Trace  # on the real clock

    @property
    def ratio(self) -> float:
        return self.realtime_makespan_seconds / self.makespan_seconds if self.makespan_seconds else 0.0

    @property
    def host_seconds_per_step(self) -> float:
        return sum(self.host_seconds.values()) / self.steps if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"makespan_seconds": self.makespan_seconds,
                "realtime_makespan_seconds": self.realtime_makespan_seconds, "realtime_ratio": self.ratio,
                "realtime_steps": self.steps, "host_seconds": self.host_seconds,
                "host_seconds_per_step": self.host_seconds_per_step}  # fmt: skip


@frozen
class TokenLatency:
    """Per-token decode latency: seconds per generated token of one sequence, the time of a decode
    step (each step gives every sequence of the batch one token), as batch-1 papers report it. The
    mean and the 50th and 90th percentiles over the batch's decode steps, those not simulated
    interpolated as the decode time is (`interpolate`)."""

    mean: float
    p50: float
    p90: float

    @classmethod
    def of(cls, steps: Sequence[float]) -> TokenLatency | None:
        """Over the decode steps' times (seconds); None without a decode step."""
        if not steps:
            return None
        if len(steps) == 1:
            return cls(steps[0], steps[0], steps[0])
        deciles = statistics.quantiles(steps, n=10, method="inclusive")
        return cls(statistics.fmean(steps), statistics.median(steps), deciles[8])

    def to_json(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90}


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
    stats: RunStats | None = None  # over the whole batch (the simulated decode steps weighted)
    trace: Trace | None = None
    simulated_steps: int = 0
    simulated_seconds: float = 0.0  # the simulated steps back to back on the virtual clock
    error: str | None = None  # why it could not run (memory), instead of figures
    realtime: RealtimeRun | None = None
    token_latency: TokenLatency | None = None  # per-token decode latency (None: no decode step ran)
    gpu_experts: int | None = None  # experts the GPU holds: an expert cache's slots, else those resident
    experts_per_layer: float | None = None  # gpu_experts per MoE layer
    report: tuple[tuple[str, float], ...] = ()  # the scheduler's own figures (`Scheduler.report`)
    cpu_attention: float | None = None  # share of decode attention rows run on the CPU (`on_cpu`)
    cpu_experts: float | None = None  # share of decode routed-expert rows run on the CPU

    @property
    def lanes(self) -> tuple[LaneStats, ...]:
        return self.stats.lanes if self.stats is not None else ()

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def throughput(self) -> float:
        """Generated tokens / (prefill + decode) seconds."""
        return self.generated / self.seconds if self.seconds and self.error is None else 0.0

    def utilisation(self, lane: LaneStats) -> float:
        """The lane's busy share (traces/stats.py: busy time / makespan, makespan = prefill + decode)."""
        return lane.share

    def to_json(self) -> dict[str, Any]:
        p = self.policy  # its placements and shares, then its scheduler's own options
        policy = {"batch_size": p.batch_size, "micro_batch_size": p.micro_batch_size,
                  "micro_batches": p.micro_batches, "attention_on": p.attention_on, "ffn_on": p.ffn_on,
                  "weights_gpu_share": p.weights_gpu_share, "kv_gpu_share": p.kv_gpu_share,
                  "gpu_memory": p.gpu_memory, "cpu_threads": p.cpu_threads,
                  **asdict(p.options_for(load(self.scheduler).Options))}  # fmt: skip
        lanes = [{**lane.to_json(), "utilisation": lane.share} for lane in self.lanes]
        stats = self.stats.to_json() if self.stats is not None else None
        realtime = self.realtime.to_json() if self.realtime is not None else {}
        return {
            "scheduler": self.scheduler, "error": self.error, "policy": policy, "sequences": self.sequences,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated,
            "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
            "throughput_tokens_per_second": self.throughput, "simulated_steps": self.simulated_steps,
            "gpu_memory_bytes": self.memory.total, "lanes": lanes, "stats": stats,
            "makespan_seconds": self.simulated_seconds,
            "token_latency_seconds": self.token_latency.to_json() if self.token_latency else None,
            "gpu_experts": self.gpu_experts, "gpu_experts_per_layer": self.experts_per_layer,
            "scheduler_report": dict(self.report), "decode_attention_cpu_share": self.cpu_attention,
            "decode_experts_cpu_share": self.cpu_experts, **realtime,
        }  # fmt: skip


def on_cpu(spans: Sequence[Span], ops: frozenset[Op]) -> float | None:
    """The share of the rows (tokens) of the nodes of `ops` that ran on the CPU: where a plan ran its
    attention (CPU_ATTN / GPU_ATTN) or its routed experts (EXPERT_FFN); None where none ran."""
    rows = [(s.node.rows or 1, s.node.lane is Lane.CPU_COMPUTE) for s in spans if s.node.op in ops]
    total = sum(r for r, _ in rows)
    return sum(r for r, cpu in rows if cpu) / total if total else None


def records(spans: Sequence[Span]) -> list[SpanRecord]:
    """Spans as the statistics read them (microseconds; a saved trace holds them to the nanosecond)."""
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
            s.node.layer,
            s.node.expert,
            s.node.bytes,
        )
        for s in spans
    ]


def trace_stats(trace: Trace) -> RunStats:
    """The run statistics of a trace, as `flowmoe trace summarize` computes them from its file."""
    return run_stats(records(trace.spans), _windows(trace))


def _windows(trace: Trace) -> list[Window]:
    """The trace's step windows as the statistics read them (microseconds)."""
    return [
        Window(w.start * 1e6, w.end * 1e6, w.weight, None if w.host_seconds is None else w.host_seconds * 1e6)
        for w in trace.steps
    ]


def trace_device_stats(trace: Trace) -> DeviceStats:
    """What the device did inside the GPU lanes' spans, from the trace's kernels (--trace-kernels), as
    `flowmoe trace summarize` computes it from its file."""
    windows = _windows(trace)
    kernels = [
        KernelRecord(None if k.lane is None else str(k.lane), k.node, k.start * 1e6, k.end * 1e6)
        for k in trace.kernels
    ]
    spans = records(trace.spans)
    return device_stats(run_stats(spans, windows), spans, kernels, windows)


def batch_trace(name: str, runs: Sequence[StepRun], at: Sequence[int], count: int) -> Trace:
    """The simulated steps as one trace, each step's window weighted by the steps it stands for:
    the prefill once, each simulated decode step by its share of the interpolation over `count`."""
    weights = [1.0, *step_weights(at, count)]
    trace = Trace(name=name)
    for run, weight in zip(runs, weights, strict=True):
        trace.extend(list(run.spans), window=StepWindow(run.start, run.end, weight))
    return trace


def step_weights(at: Sequence[int], count: int) -> list[float]:
    """w such that interpolate(values, at, count) == sum(w[k] * values[k]) (it is linear)."""
    return [interpolate([1.0 if j == k else 0.0 for j in range(len(at))], at, count) for k in range(len(at))]


def interpolate(values: Sequence[float], at: Sequence[int], count: int) -> float:
    """Sum over 0..count-1 of the piecewise-linear interpolation of `values` known at ascending `at`."""
    return sum(interpolated(values, at, count))


def interpolated(values: Sequence[float], at: Sequence[int], count: int) -> list[float]:
    """The piecewise-linear interpolation of `values` known at ascending `at`, at 0..count-1 (flat
    outside them); empty without values."""
    if not values:
        return []
    each = []
    for i in range(count):
        right = next((k for k, a in enumerate(at) if a >= i), len(at) - 1)
        left = right - 1 if at[right] > i and right > 0 else right
        if at[right] == at[left]:
            each.append(values[right])
        else:
            w = (i - at[left]) / (at[right] - at[left])
            each.append(values[left] * (1 - w) + values[right] * w)
    return each
