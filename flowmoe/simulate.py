"""Run a scheduler's plans on the SimWorker under a virtual clock, routing from a trace."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowmoe.core.driver import drive
from flowmoe.core.executor import Executor, Span
from flowmoe.core.plan import Lane, TaskNode
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import Scheduler, StepShape
from flowmoe.devices.sim import SimWorker, run_virtual


def simulate(
    scheduler: Scheduler, steps: Sequence[StepShape], trace: RoutingTrace, cost: Callable[[TaskNode], float]
) -> list[Span]:
    """Every step's plan through one executor per step, back to back on one virtual clock."""

    async def run() -> list[Span]:
        import asyncio

        loop = asyncio.get_running_loop()
        worker = SimWorker(cost)
        spans: list[Span] = []
        for step in steps:
            executor = Executor(dict.fromkeys(Lane, worker), clock=loop.time)
            answer = lambda request, s=step.step: trace.answer(s, request)  # noqa: E731
            await drive(scheduler.plan(step), executor, lambda _node: None, answer)
            spans.extend(executor.spans)
        return spans

    return run_virtual(run())
