"""A run's trace: spans of what ran where, counters (memory in use, pages resident, KV bytes), the
window of each step (what the run statistics weigh and divide by) and, with --trace-kernels, the
kernels and copies that really ran (traces/profiler.py)."""

from __future__ import annotations

from attrs import define, field, frozen

from flowmoe.core.executor import Span
from flowmoe.core.plan import Lane


@frozen(slots=True)
class CounterSample:
    name: str  # e.g. "gpu memory bytes"
    device: str  # "gpu" | "cpu"
    time: float  # seconds on the run's clock
    value: float


@frozen(slots=True)
class StepWindow:
    """One step on the run's clock. `weight`: how many steps of the batch it stands for (a
    simulation runs a few decode steps and interpolates the others); `host_seconds`: CPU time the
    host stack spent on it, where measured."""

    start: float
    end: float
    weight: float = 1.0
    host_seconds: float | None = None


@frozen(slots=True)
class KernelSlice:
    """One kernel, copy or memset the device ran (on a CPU-only run: one top-level CPU operation of a
    node on an emulated GPU lane), on the run's clock. `lane`: the GPU lane whose stream ran it (None:
    a stream no node launched on); `stream`: the CUDA stream (the host thread on the CPU); `node`: the
    id of the node that launched it, where known."""

    name: str
    kind: str  # "kernel" | "memcpy" | "memset" | "cpu_op"
    start: float  # seconds on the run's clock
    end: float
    lane: Lane | None
    stream: int
    node: int | None = None


@define
class Trace:
    """Everything one run (or one scheduler of a comparison) recorded."""

    name: str = "flowmoe"
    spans: list[Span] = field(factory=list)
    counters: list[CounterSample] = field(factory=list)
    steps: list[StepWindow] = field(factory=list)
    gpu_emulated: bool = False  # no GPU: the gpu.* lanes ran on the CPU (the lanes keep their names)
    kernels: list[KernelSlice] = field(factory=list)  # with --trace-kernels: what the device ran

    def extend(
        self,
        spans: list[Span],
        counters: list[CounterSample] | None = None,
        window: StepWindow | None = None,
        host_seconds: float | None = None,
    ) -> None:
        """One step's spans; its window is `window`, or from its first start to its last end (with
        `host_seconds`, the host's CPU time in the step)."""
        self.spans.extend(spans)
        self.counters.extend(counters or [])
        if window is None and spans:
            window = StepWindow(min(s.start for s in spans), max(s.end for s in spans), 1.0, host_seconds)
        if window is not None:
            self.steps.append(window)

    @property
    def origin(self) -> float:
        starts = (
            [s.start for s in self.spans]
            + [c.time for c in self.counters]
            + [w.start for w in self.steps]
            + [k.start for k in self.kernels]
        )
        return min(starts) if starts else 0.0
