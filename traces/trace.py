"""A run's trace: spans of what ran where, counters (memory in use, pages resident, KV bytes) and
the window of each step (what the run statistics weigh and divide by)."""

from __future__ import annotations

from attrs import define, field, frozen

from flowmoe.core.executor import Span


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


@define
class Trace:
    """Everything one run (or one scheduler of a comparison) recorded."""

    name: str = "flowmoe"
    spans: list[Span] = field(factory=list)
    counters: list[CounterSample] = field(factory=list)
    steps: list[StepWindow] = field(factory=list)
    gpu_emulated: bool = False  # no GPU: the gpu.* lanes ran on the CPU (the lanes keep their names)

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
            [s.start for s in self.spans] + [c.time for c in self.counters] + [w.start for w in self.steps]
        )
        return min(starts) if starts else 0.0
