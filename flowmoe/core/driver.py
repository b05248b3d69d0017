"""Drive a scheduler's plan through the executor: submit nodes, answer routing requests."""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen

from flowmoe.core.errors import PlanError
from flowmoe.core.executor import Action, Executor
from flowmoe.core.page_runs import page_runs
from flowmoe.core.plan import ExpertCounts, RoutingRequest, TaskNode
from flowmoe.core.scheduling import PlanStream, WrappedPlan

ActionFor = Callable[[TaskNode], Action]
Answer = Callable[[RoutingRequest], ExpertCounts]


@frozen
class NodeBudget:
    """The most nodes one step's plan may emit, and what to say when a plan goes past it."""

    limit: int
    refusal: str


class _Within(WrappedPlan):
    """`plan`, refused (PlanError) at its node past `budget`: a plan stream of its own, not a generator
    wrapped round it, so each item costs one call more, not two generator frames."""

    def __init__(self, plan: PlanStream, budget: NodeBudget) -> None:
        self.plan, self.budget, self.left = plan, budget, budget.limit

    def send(self, reply: ExpertCounts | None) -> TaskNode | RoutingRequest:
        item = self.plan.send(reply)
        if isinstance(item, TaskNode):
            self.left -= 1
            if self.left < 0:
                self.plan.close()
                raise PlanError(f"{self.budget.refusal} (more than {self.budget.limit} nodes in one step)")
        return item


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
    emits back to back go as one node each (`page_runs`), in a real run and a simulated one alike;
    the budget counts the plan's own nodes."""
    plan = page_runs(plan if budget is None else _Within(plan, budget))
    submit, send = executor.submit, plan.send
    reply: ExpertCounts | None = None
    try:
        while True:  # a for loop over the plan, with each routing answer sent back into it
            try:
                item = send(reply)
            except StopIteration:
                break
            if isinstance(item, TaskNode):
                reply = None
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
        plan.close()
