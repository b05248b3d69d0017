"""Token sampling: greedy, or temperature with top-k / top-p, seeded per request."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

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

    def generator(self, request_id: str | int) -> torch.Generator | None:
        """A generator of its own for each request, seeded from --seed and the request's id, so
        its tokens depend neither on which requests share its batch nor on its place in the file
        (a resumed job draws the same tokens)."""
        if self.greedy:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """logits: [B, vocab] float32, one SamplingParams and one generator per row -> B next-token ids."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample(row, p, g) for row, p, g in zip(logits, params, generators, strict=True)]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float32 -> the next token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = _scaled(logits, params.temperature)
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


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [vocab] / temperature, finite wherever the logits are for every temperature > 0 the
    flag accepts: a temperature so small (1e-320) that the division overflows float32 is taken in
    float64 from the largest logit down, where it is 0 at the top and -inf below, i.e. greedy with
    ties shared."""
    scores = logits / temperature
    if bool((torch.isinf(scores) & torch.isfinite(logits)).any()):
        scores = (logits.double() - logits.max().double()) / temperature  # [vocab] float64
    return scores
