"""Routers particular to one family: Llama 4's top-k then sigmoid, Phi-3.5-MoE's sparsemixer (its
inference path) and ERNIE 4.5's softmax with a selection-only bias. Each maps x and the router
weights to (indices [T, k], weights [T, k]) as `router.choose` does, on x's device with no host sync."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flowmoe.core.spec import MoESpec

Choice = tuple[torch.Tensor, torch.Tensor]


def topk_sigmoid(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec, _sel: torch.Tensor | None
) -> Choice:
    """Llama 4: the top-k logits, each through a sigmoid (no normalisation across the k)."""
    logits = F.linear(x, weight, bias)  # [T, E]
    top, indices = torch.topk(logits, moe.top_k, dim=-1)  # [T, k]
    return indices, torch.sigmoid(top.float()).to(logits.dtype)


def sparsemixer(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec, _sel: torch.Tensor | None
) -> Choice:
    """Phi-3.5-MoE at inference: the best expert, then the best of the rest; each one's weight is a
    softmax over the experts whose logit is within a relative 2 * jitter_eps of its own."""
    scores = F.linear(x, weight, bias)  # [T, E]
    first, w_first = _pick(scores, scores, moe.jitter_eps)
    second, w_second = _pick(scores, scores.scatter(-1, first, float("-inf")), moe.jitter_eps)
    return torch.cat([first, second], dim=-1), torch.cat([w_first, w_second], dim=-1)


def _pick(scores: torch.Tensor, candidates: torch.Tensor, eps: float) -> Choice:
    """scores, candidates: [T, E] -> (the best candidate [T, 1], its masked-softmax weight [T, 1])."""
    best, index = candidates.max(dim=-1, keepdim=True)  # [T, 1]
    factor = scores.abs().clamp(min=best)
    far = (best - scores) / factor > 2 * eps  # [T, E]
    probs = torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
    return index, probs.gather(-1, index)


def softmax_biased_topk(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec, sel: torch.Tensor | None
) -> Choice:
    """ERNIE 4.5: float32 softmax; the k best of softmax + selection bias; their softmax weights,
    renormalised (the sum floored at norm_min)."""
    logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # [T, E]
    probs = torch.softmax(logits, dim=-1)
    chosen = probs if sel is None else probs + sel.reshape(-1).float()
    _, indices = torch.topk(chosen, moe.top_k, dim=-1)  # [T, k]
    weights = probs.gather(-1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=moe.norm_min)
    return indices, weights.to(x.dtype)


FAMILY_ROUTERS: dict[str, Callable[..., Choice]] = {
    "topk_sigmoid": topk_sigmoid,
    "sparsemixer": sparsemixer,
    "softmax_biased_topk": softmax_biased_topk,
}
