"""Coarser page nodes where the schedule allows: a run of pages of one expert (or dense part) that a
plan emits back to back, with nothing of the plan between them, becomes one PAGE_COPY node.

A scheduler pages its weights (`page_bytes`, the policy's knob) so that other transfers can go
between the pages on the link; a lane runs its nodes one at a time in emission order, so where a plan
emits the pages of one expert one after another, nothing can run between them on their lane and the
pages might as well be one copy: one node, one launch, one copy operation instead of one per page.
`page_runs` merges such a run as the plan streams: the next page joins when it is the run's next page
of the same expert, lane and layer, with the same page count, and waits for nothing the run's first
page does not already wait for (or the run itself). A page that waits for something else (its own
staging copy, MoE-Lightning's W_CTOPIN) or any other item of the plan (a node, a routing request)
ends the run, so what interleaves on the link stays as planned.

The merged node takes the id of the run's last page (later nodes' deps on any page of the run are
pointed at it) and the sum of the pages' bytes and flops, so the cost model prices it as the run.
"""

from __future__ import annotations

import sys

from attrs import evolve

from flowmoe.core.plan import ExpertCounts, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import NodeBudget, PlanStream


def page_runs(plan: PlanStream, budget: NodeBudget | None = None) -> PlanStream:
    """`plan` with each run of consecutive pages of one expert merged into one PAGE_COPY node; refused
    (PlanError) at its node past `budget` (the plan's own nodes count), before nodes pile up in memory."""
    run, emitted = _Run(), 0
    limit = sys.maxsize if budget is None else budget.limit
    merged: dict[int, int] = {}  # id of a page merged into a run -> the run's node id
    reply: ExpertCounts | None = None
    try:
        while True:  # PlanItems' loop, inlined: one generator frame less per item of every plan
            try:
                item = plan.send(reply)
            except StopIteration:
                break
            reply = None
            if isinstance(item, RoutingRequest):
                yield from run.flushed(merged)
                reply = yield evolve(item, after=merged[item.after]) if item.after in merged else item
                continue
            emitted += 1
            if emitted > limit:
                assert budget is not None  # the limit is sys.maxsize without one
                raise budget.refused()
            node = _pointed(item, merged) if merged else item
            if run.pages and run.extended(node):
                continue
            if run.pages:
                yield from run.flushed(merged)
                node = _pointed(node, merged)  # its deps on the run just ended
            if node.op is Op.PAGE_COPY and node.part >= 0 and not node.sync:
                run.begin(node)
            else:
                yield node
        yield from run.flushed(merged)
    finally:
        plan.close()


def _pointed(node: TaskNode, merged: dict[int, int]) -> TaskNode:
    """`node` with its deps on merged pages pointed at their run's node."""
    if merged.keys().isdisjoint(node.deps):
        return node
    return evolve(node, deps=tuple(dict.fromkeys(merged.get(d, d) for d in node.deps)))


class _Run:
    """The pages of the run being merged, what they share, and what its next page may wait for."""

    def __init__(self) -> None:
        self.pages: list[TaskNode] = []
        self.kind: tuple[object, ...] = ()
        self.allowed: set[int] = set()  # the first page's deps and the run's pages

    def begin(self, node: TaskNode) -> None:
        self.pages.append(node)
        self.kind = _kind(node)
        self.allowed = {*node.deps, node.id}

    def extended(self, node: TaskNode) -> bool:
        """Whether `node` is the next page of the run's expert (one is begun) and waits for nothing new
        (it joins)."""
        if node.sync:
            return False
        last = self.pages[-1]
        if not last.part + last.pages == node.part < node.parts or _kind(node) != self.kind:
            return False
        if not self.allowed.issuperset(node.deps):
            return False
        self.pages.append(node)
        self.allowed.add(node.id)
        return True

    def flushed(self, merged: dict[int, int]) -> list[TaskNode]:
        """The run as one node (and the run emptied): the last page's id, the first page's deps."""
        pages = self.pages
        if not pages:
            return []
        first, last = pages[0], pages[-1]
        merged.update((n.id, last.id) for n in pages[:-1])
        node = evolve(
            last,
            deps=first.deps,
            part=first.part,
            pages=sum(n.pages for n in pages),
            bytes=sum(n.bytes for n in pages),
            flops=sum(n.flops for n in pages),
        )
        self.pages = []
        return [node]


def _kind(node: TaskNode) -> tuple[object, ...]:
    """What the pages of one run share."""
    return node.op, node.lane, node.layer, node.mb, node.expert, node.more, node.parts, node.pageable
