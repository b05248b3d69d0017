"""Token sampling: greedy, or temperature with top-k / top-p, seeded per request."""

from __future__ import annotations

import torch
from attrs import frozen

from flowmoe.core.errors import ConfigError


@frozen
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, request_index: int) -> torch.Generator | None:
        """A generator of its own for each request, so a request's tokens do not depend on
        which other requests share its batch."""
        if self.greedy:
            return None
        return torch.Generator().manual_seed(self.seed * 1_000_003 + request_index)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float32 -> the next token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
