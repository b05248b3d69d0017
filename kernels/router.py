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
    logits = F.linear(x, weight, bias)  # [T, E]
    if moe.router == "topk_softmax":
        top, indices = torch.topk(logits, moe.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
        weights, indices = torch.topk(probs, moe.top_k, dim=-1)  # [T, k]
        if moe.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not moe.combine_fp32:
            weights = weights.to(x.dtype)
    return group_by_expert(indices, weights, moe.experts)


def group_by_expert(indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs by expert: one stable sort instead of a mask per expert."""
    top_k = indices.shape[1]
    flat = indices.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # [T * k]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = order // top_k  # [T * k] token row of each sorted pair
    scales = weights.reshape(-1)[order]
    tokens: dict[int, torch.Tensor] = {}
    expert_scales: dict[int, torch.Tensor] = {}
    start = 0
    for expert, count in enumerate(counts):
        if count:
            tokens[expert] = rows[start : start + count]
            expert_scales[expert] = scales[start : start + count]
        start += count
    return Routing(indices, weights, tuple(tokens), tokens, expert_scales)
