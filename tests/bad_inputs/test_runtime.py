"""Bad input to the runtime itself: a plan that would emit an unbounded number of nodes is refused in
one line naming the scheduler and the policy knob, before the nodes pile up in memory."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from flowmoe.core.driver import drive
from flowmoe.core.errors import PlanError
from flowmoe.core.executor import Executor
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import NodeBudget
from flowmoe.devices.inline import InlineWorker
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import node_budget
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.shared_options import PagedOptions
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_scheduler


@pytest.mark.parametrize("pages_from", [0, 500, None])
def test_an_endless_plan_is_refused_at_the_budget(pages_from: int | None) -> None:
    """Refused wherever the plan's pages begin (`pages_from`: the first page's index; None: no page at
    all): page_runs counts the plan's own nodes, merged pages or not."""
    started: list[int] = []

    def endless() -> Iterator[TaskNode]:
        for i in itertools.count():
            op = Op.PAGE_COPY if pages_from is not None and i >= pages_from else Op.EMBED
            yield TaskNode(i, op, Lane.GPU_H2D, deps=(i - 1,) if i else ())

    async def go() -> None:
        executor = Executor(dict.fromkeys(Lane, InlineWorker()))
        budget = NodeBudget(1000, "scheduler endless plans too many nodes")
        await drive(endless(), executor, lambda n: lambda: started.append(n.id), lambda r: None, budget)

    with pytest.raises(PlanError, match=r"^scheduler endless plans too many nodes \(more than 1000 nodes"):
        asyncio.run(go())
    assert len(started) <= 1000


def test_the_budget_is_far_above_a_paper_scale_plan() -> None:
    """cgopipe at Mixtral-8x7B with 4 micro-batches plans ~6,150 nodes per step (issue 13)."""
    from flowmoe.core.presets import preset

    budget = node_budget(preset("mixtral-8x7b"), "cgopipe", micro_batches=4)
    assert budget.limit > 40 * 6_150


def test_a_one_byte_page_is_refused_naming_the_scheduler_and_the_knob(tmp_path) -> None:
    """`--scheduler lru-cache --page-size 1B`: the CLI checks --page-size against the model's experts,
    and the runtime refuses any plan past its budget (cgopipe at 1 B pages took 3 GB of RSS and made no
    progress before; it now copies an expert's pages of a chunk as one node, next test)."""
    model = load_model(save_hf(hf_model("mixtral"), tmp_path / "mixtral"))
    policy = Policy(3, 2, weights_gpu_share=0.5, options=(LRUCacheOptions(page_bytes=1),))
    with pytest.raises(PlanError) as info:
        run_scheduler(model, "lru-cache", policy)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("scheduler lru-cache plans too many nodes for one step of this model: ")
    assert "--page-size" in message
    assert f"at least {-(-model.spec.expert_bytes // 256)} B" in message


def test_cgopipe_at_one_byte_pages_copies_each_experts_pages_of_a_chunk_as_one_node(tmp_path) -> None:
    """Pinned (as the runtime keeps them), cgopipe's pages of one expert in a chunk go as one node,
    worked out without listing the pages: a 1 B page plans no more nodes than a large one, and the
    tokens are eager's."""
    model = load_model(save_hf(hf_model("mixtral"), tmp_path / "mixtral"))
    policy = Policy(3, 2, weights_gpu_share=0.0, options=(PagedOptions(page_bytes=1),))
    (tokens, _), runtime = run_scheduler(model, "cgopipe", policy)
    assert tokens == run_eager(model)[0]
    copies = [s.node for s in runtime.trace.spans if s.node.op is Op.PAGE_COPY]
    assert copies and all(n.parts == model.spec.expert_bytes for n in copies)
    chunks = policy.micro_batches  # per layer and step: each chunk cuts at most one expert in two
    assert len(copies) <= runtime.steps * model.spec.layers * (model.spec.moe.experts + chunks)
