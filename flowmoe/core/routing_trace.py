"""Routing traces: which experts each (step, layer, micro-batch) used, to drive schedulers without a model.

A trace is recorded from a real run (`flowmoe run --record-routing`) or made
synthetically; replaying it answers a scheduler's RoutingRequests, so a plan can
be simulated or snapshot-tested with no tensors at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from attrs import define, field

from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import ExpertCounts, Lane, RoutingRequest, TaskNode
from flowmoe.core.scheduling import PlanStream

Key = tuple[int, int, int]  # (step, layer, micro-batch)


@define
class RoutingTrace:
    counts: dict[Key, ExpertCounts] = field(factory=dict)
    predicted: dict[Key, ExpertCounts] = field(factory=dict)  # pre-gate predictions, when recorded

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
        return ExpertCounts(request.layer, request.mb, found.counts)

    def save(self, path: str | Path) -> None:
        rows = [
            {
                "step": k[0],
                "layer": k[1],
                "mb": k[2],
                "counts": [list(c) for c in v.counts],
                "speculative": spec,
            }
            for spec, table in ((False, self.counts), (True, self.predicted))
            for k, v in sorted(table.items())
        ]
        Path(path).write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        trace = cls()
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                answer = ExpertCounts(
                    row["layer"], row["mb"], tuple((int(e), int(n)) for e, n in row["counts"])
                )
                trace.record(int(row["step"]), answer, bool(row.get("speculative", False)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{number}: not a routing trace line ({exc})") from exc
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
