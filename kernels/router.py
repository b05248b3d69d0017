"""Top-k expert routing as each family computes it, and the per-expert token lists it implies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attrs import frozen

from flowmoe.core.spec import MoESpec


@frozen
class Routing:
    """The gate's decision for the T tokens of one micro-batch at one layer."""

    indices: torch.Tensor  # [T, k] int64 expert of each (token, slot)
    weights: torch.Tensor  # [T, k] combine weight of each (token, slot)
    experts: tuple[int, ...]  # experts with at least one token, ascending
    tokens: dict[int, torch.Tensor]  # expert -> [n_e] int64 token rows
    scales: dict[int, torch.Tensor]  # expert -> [n_e] combine weights

    def counts(self) -> dict[int, int]:
        return {e: int(self.tokens[e].numel()) for e in self.experts}


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec) -> Routing:
    """x: [T, hidden], weight: [E, hidden] -> Routing."""
    indices, weights = choose(x, weight, bias, moe)
    return group_by_expert(indices, weights, moe.experts)


def choose(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k choice alone, on x's device with no host sync: -> indices [T, k], weights [T, k]."""
    logits = F.linear(x, weight, bias)  # [T, E]
    if moe.router == "topk_softmax":
        top, indices = torch.topk(logits, moe.top_k, dim=-1)  # [T, k]
        return indices, torch.softmax(top, dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, indices = torch.topk(probs, moe.top_k, dim=-1)  # [T, k]
    if moe.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.combine_fp32:
        weights = weights.to(x.dtype)
    return indices, weights


def group_by_expert(indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs by expert: one stable sort instead of a mask per expert."""
    rows, scales, counts = sort_by_expert(indices, weights, num_experts)
    return split_by_expert(indices, weights, rows, scales, counts.tolist())


def sort_by_expert(
    indices: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half, no host sync: -> token rows [T * k] and scales [T * k] sorted by expert,
    tokens per expert [E]."""
    flat = indices.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # [T * k]
    rows = order // indices.shape[1]  # [T * k] token row of each sorted pair
    return rows, weights.reshape(-1)[order], torch.bincount(flat, minlength=num_experts)


def split_by_expert(
    indices: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, counts: list[int]
) -> Routing:
    """The host half: slice the sorted rows and scales by the counts read back (views, no kernel)."""
    tokens: dict[int, torch.Tensor] = {}
    expert_scales: dict[int, torch.Tensor] = {}
    start = 0
    for expert, count in enumerate(counts):
        if count:
            tokens[expert] = rows[start : start + count]
            expert_scales[expert] = scales[start : start + count]
        start += count
    return Routing(indices, weights, tuple(tokens), tokens, expert_scales)
