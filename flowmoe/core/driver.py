"""Drive a scheduler's plan through the executor: submit nodes, answer routing requests."""

from __future__ import annotations

import sys
from collections.abc import Callable

from flowmoe.core.executor import Action, Executor
from flowmoe.core.page_runs import page_runs
from flowmoe.core.plan import ExpertCounts, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import NodeBudget, PlanStream

ActionFor = Callable[[TaskNode], Action]
Answer = Callable[[RoutingRequest], ExpertCounts]


async def drive(
    plan: PlanStream,
    executor: Executor,
    action_for: ActionFor,
    answer: Answer,
    budget: NodeBudget | None = None,
) -> None:
    """Feed `plan` to `executor` until it is exhausted and every node has run.

    A routing request is answered once the node it names is done, from `answer`
    (the gate's real output, or a routing trace). A plan that emits more nodes than
    `budget` allows is refused (PlanError) before they pile up in memory. Any
    failure or cancellation stops every lane from starting new work and waits for
    in-flight nodes before it propagates, so what ran is fully recorded. Runs of pages the plan
    emits back to back go as one node each (`page_runs`), in a real run and a simulated one alike:
    from the plan's first PAGE_COPY on, its items go through `page_runs`, which then holds it to
    the budget (the items before it have nothing to merge, and go without a generator between);
    the budget counts the plan's own nodes."""
    submit, send, stream = executor.submit, plan.send, plan
    limit = sys.maxsize if budget is None else budget.limit
    emitted = 0  # the plan's nodes so far, until `page_runs` counts them
    reply: ExpertCounts | None = None
    try:
        while True:  # a for loop over the plan, with each routing answer sent back into it
            try:
                item = send(reply)
            except StopIteration:
                break
            if isinstance(item, TaskNode):
                reply = None
                if stream is plan:
                    emitted += 1
                    if emitted > limit:
                        assert budget is not None  # the limit is sys.maxsize without one
                        raise budget.refused()
                    if item.op is Op.PAGE_COPY:  # pages may come: the rest of the plan through page_runs
                        stream = page_runs(_resumed(item, plan), budget, emitted - 1)
                        send = stream.send
                        continue
                submit(item, action_for(item))
            else:
                await executor.wait(item.after)
                reply = answer(item)
        await executor.drain()
    except BaseException:
        executor.cancel()
        await executor.settle()
        raise
    finally:
        stream.close()


def _resumed(first: TaskNode, plan: PlanStream) -> PlanStream:
    """`plan` from `first` on, an item already taken from it; closed with it."""
    try:
        yield first
        yield from plan
    finally:
        plan.close()
