"""Sampling: greedy, temperature, top-k, top-p; seeded per request and reproducible."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from flowmoe.core.errors import ConfigError
from flowmoe.jobs.batching import BatchLimits, Request
from flowmoe.jobs.engine import Engine, eager_step
from flowmoe.jobs.sampling import SamplingParams, sample, sample_rows
from flowmoe.model.loading import load_model

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]))  # probabilities 0.05 0.4 0.3 0.15 0.1


def _draws(params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """Token counts of n draws: [vocab]."""
    generator = params.generator("draws")
    tokens = torch.tensor([sample(logits, params, generator) for _ in range(n)])
    return torch.bincount(tokens, minlength=logits.numel())


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    assert greedy.greedy and greedy.generator("x") is None
    assert sample_rows(logits, [greedy] * 6, [None] * 6) == logits.argmax(-1).tolist()
    assert sample(logits[2], greedy, None) == int(logits[2].argmax())


def test_temperature_one_follows_the_softmax() -> None:
    counts = _draws(SamplingParams(temperature=1.0))
    expected = torch.softmax(LOGITS, -1) * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # 4 degrees of freedom: p = 0.001


def test_low_temperature_sharpens() -> None:
    counts = _draws(SamplingParams(temperature=0.1), n=500)
    assert 445 < counts[1] < 495  # p(1) = 1 / (1 + 0.75 ** 10 + 0.375 ** 10 + ...) ≈ 0.947


@pytest.mark.parametrize(("top_k", "allowed"), [(1, {1}), (2, {1, 2}), (3, {1, 2, 3})])
def test_top_k_keeps_the_k_likeliest(top_k: int, allowed: set[int]) -> None:
    counts = _draws(SamplingParams(temperature=1.0, top_k=top_k), n=1000)
    assert set(counts.nonzero().flatten().tolist()) == allowed


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.3, {1}), (0.39, {1}), (0.41, {1, 2}), (0.69, {1, 2}), (0.8, {1, 2, 3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, allowed: set[int]) -> None:
    counts = _draws(SamplingParams(temperature=1.0, top_p=top_p), n=2000)
    assert set(counts.nonzero().flatten().tolist()) == allowed


def test_top_k_then_top_p_renormalised() -> None:
    # top-3 leaves 0.4 0.3 0.15 (renormalised 0.47 0.35 0.18); top-p 0.8 then drops the third
    counts = _draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.8), n=2000)
    assert set(counts.nonzero().flatten().tolist()) == {1, 2}
    assert abs(counts[1] / counts.sum() - 4 / 7) < 0.04


def test_seeded_per_request_and_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    first = _draws(params, n=50)
    assert torch.equal(first, _draws(params, n=50))
    draws = {
        key: [sample(LOGITS, p, g) for _ in range(40)]
        for key, p, g in [
            ("a", params, params.generator("a")),
            ("a again", params, params.generator("a")),
            ("b", params, params.generator("b")),
            ("a seed 8", SamplingParams(1.0, seed=8), SamplingParams(1.0, seed=8).generator("a")),
        ]
    }
    assert draws["a"] == draws["a again"]
    assert draws["a"] != draws["b"] and draws["a"] != draws["a seed 8"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "--temperature must be >= 0"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1]"),
        ({"top_k": -2}, "--top-k must be >= 0"),
    ],
)
def test_bad_params(kwargs: dict, message: str) -> None:
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        SamplingParams(**kwargs)


def test_a_requests_tokens_do_not_depend_on_its_batch(mixtral_folder: Path) -> None:
    """The same seed gives each request the same tokens whatever shares its batch or its place."""
    model = load_model(mixtral_folder)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    requests = [Request(f"s{i}", tuple(range(3 + i, 9 + 2 * i)), i) for i in range(6)]

    async def run(reqs: list[Request], limits: BatchLimits) -> dict[str, tuple[int, ...]]:
        engine = Engine(model, eager_step, params, max_new_tokens=6)
        return {r.id: r.output_ids async for r in engine.generate(reqs, limits)}

    together = asyncio.run(run(requests, BatchLimits(2, 3, 6)))
    reordered = [Request(r.id, r.input_ids, 5 - r.index) for r in reversed(requests)]
    assert asyncio.run(run(reordered[:3], BatchLimits(1, 2, 6))) == {
        k: together[k] for k in ("s5", "s4", "s3")
    }
    assert asyncio.run(run(requests, BatchLimits(2, 3, 6))) == together
    other_seed = Engine(model, eager_step, SamplingParams(1.0, 0.9, seed=4), max_new_tokens=6)

    async def other() -> dict[str, tuple[int, ...]]:
        return {r.id: r.output_ids async for r in other_seed.generate(requests, BatchLimits(2, 3, 6))}

    assert asyncio.run(other()) != together
