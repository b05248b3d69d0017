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

from attrs import evolve

from flowmoe.core.plan import Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import PlanItems, PlanStream


def page_runs(plan: PlanStream) -> PlanStream:
    """`plan` with each run of consecutive pages of one expert merged into one PAGE_COPY node."""
    run: list[TaskNode] = []
    merged: dict[int, int] = {}  # id of a page merged into a run -> the run's node id
    items = PlanItems(plan)
    try:
        for item in items:
            if isinstance(item, RoutingRequest):
                yield from _flushed(run, merged)
                items.reply = yield evolve(item, after=merged.get(item.after, item.after))
                continue
            node = _pointed(item, merged)
            if run and _extends(run, node):
                run.append(node)
                continue
            yield from _flushed(run, merged)
            node = _pointed(node, merged)  # its deps on the run just ended
            if node.op is Op.PAGE_COPY and node.part >= 0 and not node.sync:
                run.append(node)
            else:
                yield node
        yield from _flushed(run, merged)
    finally:
        plan.close()


def _pointed(node: TaskNode, merged: dict[int, int]) -> TaskNode:
    """`node` with its deps on merged pages pointed at their run's node."""
    if not merged or not any(d in merged for d in node.deps):
        return node
    return evolve(node, deps=tuple(dict.fromkeys(merged.get(d, d) for d in node.deps)))


def _extends(run: list[TaskNode], node: TaskNode) -> bool:
    """Whether `node` is the next page of `run`'s expert and waits for nothing new."""
    first, last = run[0], run[-1]
    if _kind(node) != _kind(first) or node.sync or not last.part + last.pages == node.part < node.parts:
        return False
    allowed = {*first.deps, *(n.id for n in run)}
    return all(d in allowed for d in node.deps)


def _kind(node: TaskNode) -> tuple[object, ...]:
    """What the pages of one run share."""
    return node.op, node.lane, node.layer, node.mb, node.expert, node.more, node.parts, node.pageable


def _flushed(run: list[TaskNode], merged: dict[int, int]) -> list[TaskNode]:
    """The run as one node (empties `run`): the last page's id, the first page's deps."""
    if not run:
        return []
    first, last = run[0], run[-1]
    merged.update((n.id, last.id) for n in run[:-1])
    node = evolve(
        last,
        deps=first.deps,
        part=first.part,
        pages=sum(n.pages for n in run),
        bytes=sum(n.bytes for n in run),
        flops=sum(n.flops for n in run),
    )
    run.clear()
    return [node]
