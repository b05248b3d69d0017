"""Synthetic routing traces: popularity skew, layer-to-layer correlation and token-to-token reuse.

Each layer ranks its experts in a random order and gives the r-th most popular
a weight 1 / r**skew (skew 0: uniform). A token picks its top-k experts at a
layer one at a time. Temporal locality first: in a decode step, with
probability `reuse` a slot keeps the expert the same sequence's previous token
chose in that slot at that layer (the collaborative-inference paper, §I and
§II-B, Fig. 2: on Mixtral-8x7B a selected expert is re-employed by the next
token with 30-50% probability, at least one of the two with 40-60%). The
default 0.2 is the forced share: with the chance reuse of draws (k / experts
of the rest, 2/8 on Mixtral) a selected expert is re-employed about 40% of
the time, the middle of the paper's range. Otherwise, with probability
`correlation` it follows its previous layer's expert through a fixed per-layer
successor map (expert e at layer l-1 leads to succ[l][e]), otherwise it draws
from the popularity weights; a pick already taken is redrawn. Pre-gate
predictions (for pre-gated schedulers) keep each true expert with probability
`pregate_accuracy`, else name another one.

Large micro-batches are routed from a sample of at most `max_tokens` tokens
whose counts are scaled up to the real token count: the expert shares and which
experts are hit keep their distribution, at a fraction of the sampling cost.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import ExpertCounts
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import StepShape
from flowmoe.core.spec import ModelSpec


@frozen
class RoutingModel:
    skew: float = 1.0
    correlation: float = 0.0
    pregate_accuracy: float = 0.9
    seed: int = 0
    max_tokens: int = 256
    reuse: float = 0.2  # forced token-to-token expert reuse (collaborative-inference paper, Fig. 2)

    def __attrs_post_init__(self) -> None:
        if self.skew < 0:
            raise ConfigError(f"--skew must be >= 0, got {self.skew}")
        for name in ("correlation", "pregate_accuracy", "reuse"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name.replace('_', '-')} must be in [0, 1], got {value}")
        if self.max_tokens < 1:
            raise ConfigError(f"max tokens must be at least 1, got {self.max_tokens}")


class SyntheticRouting:
    """Routing of one model under a RoutingModel; the tables depend only on the seed."""

    def __init__(self, spec: ModelSpec, model: RoutingModel) -> None:
        self.spec, self.model = spec, model
        experts, rng = spec.moe.experts, random.Random(f"routing:{model.seed}")
        self.weights: list[list[float]] = []
        self.successor: list[list[int]] = []
        for _layer in range(spec.layers):
            order = list(range(experts))
            rng.shuffle(order)
            weights = [0.0] * experts
            for rank, expert in enumerate(order):
                weights[expert] = 1.0 / (rank + 1) ** model.skew
            total = sum(weights)
            self.weights.append([w / total for w in weights])
            self.successor.append([rng.randrange(experts) for _ in range(experts)])

    @classmethod
    def observed(cls, spec: ModelSpec, recorded: RoutingTrace, model: RoutingModel) -> SyntheticRouting:
        """Popularity measured from a recorded trace (per layer; layers it never saw stay
        Zipf-skewed), the successor map and pre-gate noise from `model`."""
        routing = cls(spec, model)
        for layer, shares in enumerate(observed_popularity(spec, recorded)):
            if shares is not None:
                routing.weights[layer] = list(shares)
        return routing

    @property
    def popularity(self) -> tuple[tuple[float, ...], ...]:
        """Token share of each expert per layer (what a routing profile gives a scheduler)."""
        return tuple(tuple(w) for w in self.weights)

    def trace(self, steps: Sequence[StepShape]) -> RoutingTrace:
        trace = RoutingTrace()
        before: dict[tuple[int, int], list[list[int]]] = {}  # (mb, layer) -> last step's picks per token
        for step in steps:
            rng = random.Random(f"routing:{self.model.seed}:{step.step}")
            for mb in step.micro_batches:
                if mb.tokens:
                    self._route_micro_batch(trace, step, mb.index, mb.tokens, rng, before)
        return trace

    def _route_micro_batch(
        self,
        trace: RoutingTrace,
        step: StepShape,
        mb: int,
        tokens: int,
        rng: random.Random,
        before: dict[tuple[int, int], list[list[int]]],
    ) -> None:
        """Route one micro-batch; in a decode step token i is the next token of the sequence whose
        previous token was token i of the step before (`before`, updated here)."""
        sampled = min(tokens, self.model.max_tokens)
        previous: list[list[int]] | None = None
        for layer in range(self.spec.layers):
            if not self.spec.is_moe_layer(layer):
                previous = None
                continue
            last = before.get((mb, layer), []) if not step.prefill else []
            chosen = [
                self._pick(layer, previous[i] if previous else None, last[i] if i < len(last) else None, rng)
                for i in range(sampled)
            ]
            before[(mb, layer)] = chosen
            paths = _paths(previous, chosen, tokens) if previous else ()
            trace.record(step.step, ExpertCounts(layer, mb, _scaled(chosen, tokens), paths, _ranks(chosen)))
            if layer > 0:
                guessed = [self._guess(picks, rng) for picks in chosen]
                trace.record(step.step, ExpertCounts(layer, mb, _scaled(guessed, tokens)), speculative=True)
            previous = chosen

    def _pick(
        self, layer: int, previous: list[int] | None, last: list[int] | None, rng: random.Random
    ) -> list[int]:
        """Top-k of one token: `previous` its picks at the layer before, `last` its sequence's previous
        token's picks at this layer."""
        k, weights = self.spec.moe.top_k, self.weights[layer]
        picks: list[int] = []
        for slot in range(k):
            if last is not None and rng.random() < self.model.reuse and last[slot] not in picks:
                picks.append(last[slot])
                continue
            if previous is not None and rng.random() < self.model.correlation:
                expert = self.successor[layer][previous[slot]]
                if expert not in picks:
                    picks.append(expert)
                    continue
            while True:
                expert = rng.choices(range(len(weights)), weights)[0]
                if expert not in picks:
                    picks.append(expert)
                    break
        return picks

    def _guess(self, picks: list[int], rng: random.Random) -> list[int]:
        experts = self.spec.moe.experts
        guess = [e for e in picks if rng.random() < self.model.pregate_accuracy]
        while len(guess) < len(picks):
            other = rng.randrange(experts)
            if other not in guess:
                guess.append(other)
        return guess


def _scaled(chosen: list[list[int]], tokens: int) -> tuple[tuple[int, int], ...]:
    """Counts of the sampled tokens' picks scaled to `tokens` tokens (largest remainder),
    every picked expert keeping at least one token."""
    counts: dict[int, int] = {}
    for picks in chosen:
        for expert in picks:
            counts[expert] = counts.get(expert, 0) + 1
    scale = tokens / len(chosen)
    if scale == 1:
        return tuple(sorted(counts.items()))
    exact = {e: c * scale for e, c in counts.items()}
    whole = {e: max(1, int(v)) for e, v in exact.items()}
    short = round(sum(exact.values())) - sum(whole.values())
    for expert in sorted(exact, key=lambda e: whole[e] - exact[e])[: max(0, short)]:
        whole[expert] += 1
    return tuple(sorted((e, min(tokens, n)) for e, n in whole.items()))


def _ranks(chosen: list[list[int]]) -> tuple[tuple[int, int], ...]:
    """Each picked expert's best slot over the tokens: a token's picks in slot order stand for its
    top-k by routing weight, heaviest first (what Expert Deferral ranks by)."""
    best: dict[int, int] = {}
    for picks in chosen:
        for slot, expert in enumerate(picks):
            best[expert] = min(slot, best.get(expert, slot))
    return tuple(sorted(best.items()))


def _paths(
    previous: list[list[int]], chosen: list[list[int]], tokens: int
) -> tuple[tuple[int, int, int], ...]:
    """Tokens that went through expert a at the previous MoE layer and b here, scaled like `_scaled`
    (every pair seen keeps at least one token)."""
    pairs: dict[tuple[int, int], int] = {}
    for before, here in zip(previous, chosen, strict=True):
        for a in before:
            for b in here:
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
    scale = tokens / len(chosen)
    return tuple(sorted((a, b, max(1, round(n * scale))) for (a, b), n in pairs.items()))


def observed_popularity(spec: ModelSpec, recorded: RoutingTrace) -> list[tuple[float, ...] | None]:
    """Each layer's token share per expert in a recorded trace (None for a layer it lacks)."""
    totals = [[0] * spec.moe.experts for _ in range(spec.layers)]
    for answer in recorded.counts.values():
        if not 0 <= answer.layer < spec.layers:
            raise ConfigError(f"routing trace names layer {answer.layer}; the model has {spec.layers}")
        for expert, tokens in answer.counts:
            if not 0 <= expert < spec.moe.experts:
                raise ConfigError(f"routing trace names expert {expert}; the model has {spec.moe.experts}")
            totals[answer.layer][expert] += tokens
    return [tuple(t / sum(row) for t in row) if sum(row) else None for row in totals]
