"""The balanced micro-batch planner, slot refill, and how requests end (EOS, stop strings, length)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.core.errors import ConfigError
from flowmoe.jobs.batching import BatchLimits, Opening, Request, longest_first, plan_batch, refill_slots
from flowmoe.jobs.engine import Engine, Result, StepInput, eager_step
from flowmoe.jobs.sampling import SamplingParams
from flowmoe.kernels.attention import attend
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.builtin import ensure_builtin
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.tokenizer import StopStrings, TextCodec


def _requests(lengths: Sequence[int]) -> list[Request]:
    return [Request(f"r{i}", (5,) * n, i) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def tiny() -> MoEModel:
    return load_model(ensure_builtin())


# ---- the planner


def test_longest_first_into_the_lightest_micro_batch() -> None:
    limits = BatchLimits(micro_batches=2, micro_batch_size=3, max_new_tokens=4)
    batch, deferred = plan_batch(_requests([5, 9, 2, 7, 3, 8, 1]), limits)
    lengths = [[len(r.input_ids) for r in mb.requests] for mb in batch.micro_batches]
    # 9 -> a, 8 -> b, 7 -> b (8 < 9), 5 -> a (9 < 15), 3 -> a (14 < 15): a is full, 2 -> b; 1 waits
    assert lengths == [[9, 5, 3], [8, 7, 2]]
    assert [mb.tokens for mb in batch.micro_batches] == [17, 17]
    assert [mb.capacity for mb in batch.micro_batches] == [13, 12]
    assert [r.id for r in deferred] == ["r6"]


def test_kv_budget_bounds_slots_times_capacity() -> None:
    limits = BatchLimits(micro_batches=2, micro_batch_size=8, max_new_tokens=10, kv_budget=100)
    batch, deferred = plan_batch(_requests([40, 30, 20, 10, 10, 5]), limits)
    # capacities 50 and 40: two sequences of 50, two of 40 fit under 100 KV tokens each
    assert [[len(r.input_ids) for r in mb.requests] for mb in batch.micro_batches] == [[40, 10], [30, 20]]
    assert all(mb.kv_tokens <= 100 for mb in batch.micro_batches)
    assert [len(r.input_ids) for r in deferred] == [10, 5]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40),
    micro_batches=st.integers(1, 4),
    size=st.integers(1, 8),
    new=st.integers(1, 16),
    budget=st.one_of(st.none(), st.integers(80, 400)),
)
def test_plan_properties(
    lengths: list[int], micro_batches: int, size: int, new: int, budget: int | None
) -> None:
    limits = BatchLimits(micro_batches, size, new, budget)
    requests = _requests(lengths)
    batch, deferred = plan_batch(requests, limits)
    placed = [r for mb in batch.micro_batches for r in mb.requests]
    order = longest_first(requests)
    # every request exactly once; the batch takes the longest, deferral keeps the order
    assert sorted(r.id for r in placed + deferred) == sorted(r.id for r in requests)
    assert {r.id for r in placed} == {r.id for r in order[: len(placed)]}
    assert deferred == order[len(placed) :]
    assert placed, "a batch always takes the longest request that fits alone"
    for mb in batch.micro_batches:
        assert len(mb.requests) <= size
        assert mb.capacity == max(limits.need(r) for r in mb.requests)
        assert budget is None or mb.kv_tokens <= budget
    if budget is None and len(requests) <= micro_batches * size:
        # unconstrained list scheduling: loads differ by at most the longest prompt
        loads = [mb.tokens for mb in batch.micro_batches] + [0] * (micro_batches - len(batch.micro_batches))
        assert max(loads) - min(loads) <= max(lengths)


def test_request_too_long_is_refused(tiny: MoEModel) -> None:
    limits = BatchLimits(max_new_tokens=10, kv_budget=50)
    assert limits.problem(_requests([40])[0]) is None
    problem = limits.problem(_requests([41])[0])
    assert (
        problem == "request 'r0': 41 prompt + 10 new tokens exceed the KV budget of 50 tokens per micro-batch"
    )
    engine = Engine(tiny, eager_step, max_new_tokens=10)

    async def go() -> list[Result]:
        return [r async for r in engine.generate(_requests([3, 41]), limits)]

    with pytest.raises(ConfigError, match="'r1': 41 prompt"):
        asyncio.run(go())


def test_request_without_prompt_tokens_is_refused(tiny: MoEModel) -> None:
    """An empty prompt has no last token to predict from (once it took another request's output)."""
    limits = BatchLimits(max_new_tokens=4)
    assert limits.problem(Request("empty", ())) == "request 'empty': the prompt has no tokens"
    engine = Engine(tiny, eager_step, max_new_tokens=4)

    async def go() -> list[Result]:
        return [r async for r in engine.generate([*_requests([3]), Request("empty", (), 1)], limits)]

    with pytest.raises(ConfigError, match="'empty': the prompt has no tokens"):
        asyncio.run(go())


# ---- refill


def test_refill_takes_the_longest_that_fits_into_the_lightest() -> None:
    limits = BatchLimits(micro_batches=2, micro_batch_size=4, max_new_tokens=4)
    openings = [Opening(free=2, slots=4, capacity=12, load=3), Opening(free=1, slots=4, capacity=30, load=1)]
    queue = _requests([20, 8, 7, 6])
    taken = refill_slots(openings, queue, limits)
    # 20 (+4 new) fits only the second; 8 and 7 -> the first; 6 waits: no slot is left
    assert [[len(r.input_ids) for r in t] for t in taken] == [[8, 7], [20]]
    assert [len(r.input_ids) for r in queue] == [6]


def test_refill_stops_where_a_fresh_micro_batch_holds_more() -> None:
    limits = BatchLimits(micro_batches=1, micro_batch_size=8, max_new_tokens=10, kv_budget=120)
    # a cache of 2 slots × 60 tokens: a 30-token request would make a fresh one of 3 slots × 40
    queue = _requests([30, 10])
    assert refill_slots([Opening(1, 2, 60, 1)], queue, limits) == [[]]
    assert len(queue) == 2
    queue = _requests([45])  # 2 × 55 tokens: no better than the cache it would join
    assert [len(r.input_ids) for r in refill_slots([Opening(1, 2, 60, 1)], queue, limits)[0]] == [45]


GREEDY = SamplingParams()


def _generate(model, runner, requests, limits, sampling=GREEDY, **engine) -> dict[str, Result]:
    async def go() -> dict[str, Result]:
        e = Engine(model, runner, sampling, limits.max_new_tokens, **engine)
        return {r.id: r async for r in e.generate(requests, limits)}

    return asyncio.run(go())


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.9, 0.95, 40, seed=5)])
def test_refilled_slots_generate_what_requests_alone_do(
    mixtral_folder: Path, sampling: SamplingParams
) -> None:
    model = load_model(mixtral_folder)
    rng = random.Random(0)
    requests = [Request(f"q{i}", tuple(rng.randrange(3, 96) for _ in range(rng.randint(1, 30))), i)
                for i in range(10)]  # fmt: skip
    steps: list[StepInput] = []

    async def watching(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        steps.extend(inputs)
        return await eager_step(model, inputs)

    limits = BatchLimits(micro_batches=2, micro_batch_size=3, max_new_tokens=6, kv_budget=90)
    stop = frozenset(range(3, 96, 5))  # a fifth of the vocabulary ends a request: ends are staggered
    batched = _generate(model, watching, requests, limits, sampling, stop_ids=stop)
    alone = {
        r.id: _generate(model, eager_step, [r], BatchLimits(1, 1, 6), sampling, stop_ids=stop)[r.id]
        for r in requests
    }
    assert batched == alone
    assert {r.finish_reason for r in batched.values()} == {"stop", "length"}
    assert all(s.cache.keys[0].shape[0] * s.cache.capacity <= 90 for s in steps)
    mixed = [s for s in steps if 0 in s.layout.past and any(p > 0 for p in s.layout.past)]
    assert mixed, "a refilled slot's prefill shares a step with the others' decodes"


# ---- how a request ends


async def successor(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
    """A stand-in model: the next token is always the last token + 1."""
    out = []
    for step in inputs:
        last = step.ids[step.layout.last_rows]  # [B]
        logits = torch.zeros(len(last), model.spec.vocab)  # [B, vocab]
        logits[torch.arange(len(last)), (last + 1) % model.spec.vocab] = 1.0
        out.append(logits)
    return out


def test_eos_and_stop_strings_end_requests_and_free_their_slots(tiny: MoEModel) -> None:
    codec = TextCodec.from_folder(ensure_builtin())
    assert codec is not None
    prompts = {"eos": "x", "stop": "a", "long": "A", "after": "0"}
    requests = [Request(k, tuple(codec.encode(v)), i) for i, (k, v) in enumerate(prompts.items())]
    eos = codec.encode("}")[0]  # "x" -> "yz{|}": EOS after five tokens
    limits = BatchLimits(micro_batches=1, micro_batch_size=3, max_new_tokens=8)
    steps: list[StepInput] = []

    async def watching(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        steps.extend(inputs)
        return await successor(model, inputs)

    stops = StopStrings(codec, ("ef", "de"))
    results = _generate(tiny, watching, requests, limits, stop_ids=frozenset({eos}), stop_strings=stops)
    assert results["eos"].finish_reason == "stop" and codec.decode(results["eos"].output_ids) == "yz{|}"
    # "a" -> "bcde": the earliest stop string ("de") ends it, and the text is cut before it
    assert results["stop"].finish_reason == "stop" and results["stop"].text == "bc"
    assert codec.decode(results["stop"].output_ids) == "bcde"
    assert results["long"].finish_reason == "length" and results["long"].text is None
    assert codec.decode(results["long"].output_ids) == "BCDEFGHI"
    assert codec.decode(results["after"].output_ids) == "12345678"
    # three slots; the fourth request takes the slot "stop" freed after its fourth token
    assert (steps[0].layout.slots, steps[0].layout.past) == ((0, 1, 2), (0, 0, 0))
    assert (steps[4].layout.slots, steps[4].layout.past) == ((0, 2, 1), (4, 4, 0))
    assert steps[5].layout.slots == (2, 1)  # EOS freed slot 0 in step 4; nobody is left to take it


@pytest.mark.parametrize(("window", "sinks"), [(None, None), (3, torch.tensor([0.5, -1.0, 2.0, 0.0]))])
def test_mixed_step_attention_is_each_sequence_alone(window: int | None, sinks: torch.Tensor | None) -> None:
    """A refilled slot's prefill shares a step with decodes: decodes are attended together, the
    prefill alone; each row is what attending its sequence alone gives."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(4, 2, 12, 8, generator=generator) for _ in range(2))  # [slots, kvh, C, D]
    layout = TokenLayout(slots=(3, 0, 2, 1), counts=(1, 5, 1, 1), past=(6, 0, 9, 2))
    q = torch.randn(layout.tokens, 4, 8, generator=generator)  # [T, H, D]
    mixed = attend(q, keys, values, layout, window, sinks)
    for i, (slot, start, count, past) in enumerate(
        zip(layout.slots, layout.starts, layout.counts, layout.past, strict=True)
    ):
        alone = attend(
            q[start : start + count], keys, values, TokenLayout((slot,), (count,), (past,)), window, sinks
        )
        assert torch.allclose(mixed[start : start + count], alone, atol=1e-6), f"sequence {i}"
