"""A run's trace: spans of what ran where, and counters (memory in use, pages resident, KV bytes)."""

from __future__ import annotations

from attrs import define, field, frozen

from flowmoe.core.executor import Span


@frozen(slots=True)
class CounterSample:
    name: str  # e.g. "gpu memory bytes"
    device: str  # "gpu" | "cpu"
    time: float  # seconds on the run's clock
    value: float


@define
class Trace:
    """Everything one run (or one scheduler of a comparison) recorded."""

    name: str = "flowmoe"
    spans: list[Span] = field(factory=list)
    counters: list[CounterSample] = field(factory=list)

    def extend(self, spans: list[Span], counters: list[CounterSample] | None = None) -> None:
        self.spans.extend(spans)
        self.counters.extend(counters or [])

    @property
    def origin(self) -> float:
        starts = [s.start for s in self.spans] + [c.time for c in self.counters]
        return min(starts) if starts else 0.0

    def to_chrome(self) -> dict:
        from flowmoe.traces.chrome import chrome_trace

        return chrome_trace([self])
