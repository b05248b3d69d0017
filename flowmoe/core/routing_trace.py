"""Routing traces: which experts each (step, layer, micro-batch) used, to drive schedulers without a model.

A trace is recorded from a real run (`flowmoe run --record-routing`) or made
synthetically; replaying it answers a scheduler's RoutingRequests, so a plan can
be simulated or snapshot-tested with no tensors at all. A recorded trace starts
with the model's shape (layers, experts, top-k), so it is refused for another model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from attrs import asdict, define, field, frozen

from flowmoe.core.bounded_read import ROUTING, read_bounded
from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import ExpertCounts, Lane, RoutingRequest, TaskNode
from flowmoe.core.scheduling import PlanStream
from flowmoe.core.spec import ModelSpec
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard, OutputKind

Key = tuple[int, int, int]  # (step, layer, micro-batch)
ROUTING_FORMAT = "flowmoe-routing/1"  # the first key of a saved trace: the mark of one flowmoe wrote
ROUTING_RECORD = OutputKind("routing trace", f'{{"format": "{ROUTING_FORMAT}"'.encode())


@frozen
class RoutedShape:
    """What a routing trace's numbers mean: layer and expert indices, experts per token."""

    layers: int
    experts: int
    top_k: int

    @classmethod
    def of(cls, spec: ModelSpec) -> RoutedShape:
        return cls(spec.layers, spec.moe.experts, spec.moe.top_k)

    def describe(self) -> str:
        return f"{self.layers} layers, {self.experts} experts, top-{self.top_k}"


@define
class RoutingTrace:
    counts: dict[Key, ExpertCounts] = field(factory=dict)
    predicted: dict[Key, ExpertCounts] = field(factory=dict)  # pre-gate predictions, when recorded
    shape: RoutedShape | None = None  # the recorded model's; None for a synthetic or older trace

    @classmethod
    def for_model(cls, spec: ModelSpec) -> RoutingTrace:
        """An empty trace to record `spec`'s routing into."""
        return cls(shape=RoutedShape.of(spec))

    def check_model(self, spec: ModelSpec, where: str | Path = "routing trace") -> None:
        """Refuse a trace that was not recorded on a model of `spec`'s shape (an older trace
        without a shape: refuse one naming a layer or expert the model lacks)."""
        wanted = RoutedShape.of(spec)
        if self.shape is not None and self.shape != wanted:
            raise ConfigError(
                f"{where}: routing trace recorded on a model with {self.shape.describe()}; "
                f"this model has {wanted.describe()}"
            )
        for answer in [*self.counts.values(), *self.predicted.values()]:
            bad = [e for e, _ in answer.counts if not 0 <= e < wanted.experts]
            if not 0 <= answer.layer < wanted.layers or bad:
                named = f"layer {answer.layer}" if not bad else f"expert {bad[0]}"
                raise ConfigError(f"{where}: routing trace names {named}; this model has {wanted.describe()}")

    def record(self, step: int, answer: ExpertCounts, speculative: bool = False) -> None:
        table = self.predicted if speculative else self.counts
        table[(step, answer.layer, answer.mb)] = answer

    def answer(self, step: int, request: RoutingRequest) -> ExpertCounts:
        key = (step, request.layer, request.mb)
        table = self.predicted if request.speculative and key in self.predicted else self.counts
        if key not in table:
            raise ConfigError(
                f"routing trace has no entry for step {step} layer {request.layer} mb {request.mb}"
            )
        found = table[key]
        return ExpertCounts(request.layer, request.mb, found.counts, found.follows, found.ranks)

    def save(self, path: str | Path, guard: Guard = DEFAULT_GUARD) -> None:
        """Write through the write guard: whole, never over a file flowmoe did not write."""
        rows = [
            {
                "step": k[0],
                "layer": k[1],
                "mb": k[2],
                "counts": [list(c) for c in v.counts],
                "speculative": spec,
                **({"ranks": [list(r) for r in v.ranks]} if v.ranks else {}),
            }
            for spec, table in ((False, self.counts), (True, self.predicted))
            for k, v in sorted(table.items())
        ]
        rows.insert(0, {"format": ROUTING_FORMAT, **({"model": asdict(self.shape)} if self.shape else {})})
        text = "\n".join(json.dumps(r) for r in rows) + "\n"

        def produce(tmp: Path) -> None:
            tmp.write_text(text)

        guard.write(Path(path), ROUTING_RECORD, produce)

    @classmethod
    def load(cls, path: str | Path, spec: ModelSpec | None = None) -> RoutingTrace:
        """A saved trace; given `spec`, one recorded on a model of another shape is refused."""
        trace = cls()
        try:
            text = read_bounded(Path(path), ROUTING).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "model" in row:
                    trace.shape = RoutedShape(
                        **{k: int(row["model"][k]) for k in ("layers", "experts", "top_k")}
                    )
                if "model" in row or "format" in row:  # the header
                    continue
                answer = ExpertCounts(
                    row["layer"],
                    row["mb"],
                    tuple((int(e), int(n)) for e, n in row["counts"]),
                    ranks=tuple((int(e), int(r)) for e, r in row.get("ranks", ())),
                )
                trace.record(int(row["step"]), answer, bool(row.get("speculative", False)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as exc:
                raise ConfigError(f"{path}:{number}: not a routing trace line ({exc})") from exc
        if spec is not None:
            trace.check_model(spec, path)
        return trace


def replay(plan: PlanStream, answer: Callable[[RoutingRequest], ExpertCounts]) -> Iterator[TaskNode]:
    """Run a plan with no executor: the nodes in emission order, requests answered by `answer`."""
    reply = None
    while True:
        try:
            item = plan.send(reply)
        except StopIteration:
            return
        reply = None
        if isinstance(item, TaskNode):
            yield item
        else:
            reply = answer(item)


def lane_listing(nodes: list[TaskNode]) -> str:
    """A readable per-lane listing of node order: the form of the golden snapshots."""
    lines = []
    for lane in Lane:
        on_lane = [n for n in nodes if n.lane is lane]
        if on_lane:
            lines.append(f"[{lane}]")
            lines += [f"  {n.label}" for n in on_lane]
    return "\n".join(lines) + "\n"
