"""Drive a scheduler's plan through the executor: submit nodes, answer routing requests."""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen

from flowmoe.core.errors import PlanError
from flowmoe.core.executor import Action, Executor
from flowmoe.core.page_runs import page_runs
from flowmoe.core.plan import ExpertCounts, RoutingRequest, TaskNode
from flowmoe.core.scheduling import PlanStream

ActionFor = Callable[[TaskNode], Action]
Answer = Callable[[RoutingRequest], ExpertCounts]


@frozen
class NodeBudget:
    """The most nodes one step's plan may emit, and what to say when a plan goes past it."""

    limit: int
    refusal: str


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
    emits back to back go as one node each (`page_runs`), in a real run and a simulated one alike."""
    plan = page_runs(plan)
    reply: ExpertCounts | None = None
    left = budget.limit if budget is not None else -1
    try:
        while True:
            try:
                item = plan.send(reply)
            except StopIteration:
                break
            reply = None
            if isinstance(item, TaskNode):
                left -= 1
                if left == -1 and budget is not None:
                    raise PlanError(f"{budget.refusal} (more than {budget.limit} nodes in one step)")
                executor.submit(item, action_for(item))
            else:
                await executor.wait(item.after)
                reply = answer(item)
        await executor.drain()
    except BaseException:
        executor.cancel()
        await executor.settle()
        raise
    finally:
        plan.close()
