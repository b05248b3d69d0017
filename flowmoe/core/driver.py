"""Drive a scheduler's plan through the executor: submit nodes, answer routing requests."""

from __future__ import annotations

from collections.abc import Callable

from flowmoe.core.executor import Action, Executor
from flowmoe.core.page_runs import page_runs
from flowmoe.core.plan import ExpertCounts, RoutingRequest, TaskNode
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
    emits back to back go as one node each (`page_runs`, which also holds the plan to the budget,
    counting the plan's own nodes), in a real run and a simulated one alike."""
    stream = page_runs(plan, budget)
    submit, send = executor.submit, stream.send
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
        stream.close()
