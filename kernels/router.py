"""Top-k expert routing as each family computes it, and the per-expert token lists it implies."""

from __future__ import annotations

from functools import cached_property
from itertools import accumulate, compress

import torch
import torch.nn.functional as F
from attrs import define

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert, cpu_router
from flowmoe.kernels.family_routers import FAMILY_ROUTERS


@define(eq=False)
class Routing:
    """The gate's decision for the T tokens of one micro-batch at one layer (not to be changed once
    made: a plain attrs class, whose __init__ is a third of a frozen one's operations at every
    layer's gate)."""

    indices: torch.Tensor  # [T, k] int64 expert of each (token, slot)
    weights: torch.Tensor  # [T, k] combine weight of each (token, slot)
    experts: tuple[int, ...]  # experts with at least one token, ascending
    rows: torch.Tensor  # [T * k] every expert's token rows, experts ascending
    sorted_scales: torch.Tensor  # [T * k] their combine weights
    starts: dict[int, int]  # expert -> where its rows begin in `rows`
    sizes: dict[int, int]  # expert -> its tokens

    @cached_property
    def tokens(self) -> dict[int, torch.Tensor]:
        """expert -> [n_e] int64 token rows (views of `rows`), split on first use: the kernels that
        take a layer's experts at once read `rows` whole, so a gate dispatches no split."""
        return dict(zip(self.experts, self.rows.split(list(self.sizes.values())), strict=True))

    @cached_property
    def scales(self) -> dict[int, torch.Tensor]:
        """expert -> [n_e] combine weights (views of `sorted_scales`), split on first use."""
        return dict(zip(self.experts, self.sorted_scales.split(list(self.sizes.values())), strict=True))

    def counts(self) -> dict[int, int]:
        return dict(self.sizes)

    def rows_of(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The token rows and combine weights of `experts` in that order, [sum n_e] each: where they
        follow one another in the sorted whole (a layer's routed experts ascending, or a run of them),
        a view of it, else one cat each."""
        if len(experts) == len(self.experts) and tuple(experts) == self.experts:  # all, ascending
            return self.rows, self.sorted_scales
        start = self.starts[experts[0]]
        end = start
        for expert in experts:
            if self.starts[expert] != end:
                return torch.cat([self.tokens[e] for e in experts]), torch.cat(
                    [self.scales[e] for e in experts]
                )
            end += self.sizes[expert]
        if start == 0 and end == self.rows.shape[0]:  # no Tensor.__len__ (Python)
            return self.rows, self.sorted_scales
        return self.rows[start:end], self.sorted_scales[start:end]


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    moe: MoESpec,
    selection_bias: torch.Tensor | None = None,
) -> Routing:
    """x: [T, hidden], weight: [E, hidden] -> Routing. A softmax_topk router on the CPU finishes
    in one C call after its top-k (cpu_router: the same floats and order)."""
    if cpu_router.fits(x, moe):
        top, indices = _softmax_top(x, weight, bias, moe)
        weights, rows, scales, counts = cpu_router.tail(top, indices, moe, x.dtype)
        return split_by_expert(indices, weights, rows, scales, counts)
    indices, weights = choose(x, weight, bias, moe, selection_bias)
    return group_by_expert(indices, weights, moe.experts)


def choose(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    moe: MoESpec,
    selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k choice alone, on x's device with no host sync: -> indices [T, k], weights [T, k].
    `selection_bias` [E] (or [1, E]): added to the scores for the choice only."""
    if moe.router in ("sigmoid_group", "softmax_group"):
        return grouped_choice(x, weight, selection_bias, moe)
    if moe.router in FAMILY_ROUTERS:
        return FAMILY_ROUTERS[moe.router](x, weight, bias, moe, selection_bias)
    if moe.router == "topk_softmax":
        top, indices = torch.topk(F.linear(x, weight, bias), moe.top_k, dim=-1)  # [T, k]
        return indices, torch.softmax(top, dim=-1)
    weights, indices = _softmax_top(x, weight, bias, moe)  # [T, k] each
    if moe.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.combine_fp32:
        weights = weights.to(x.dtype)
    return indices, weights


def _softmax_top(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk's choice before renormalising: -> the top-k probabilities [T, k] float32 and
    their experts [T, k]."""
    if x.is_cpu and cpu_expert.fits(x, weight, bias):  # a decode step's few rows: oneDNN's bf16 call
        logits = cpu_expert.linear_rows(x, weight, bias)  # costs ~130 us cold there for [8, 1024] (issue 25)
    else:
        logits = F.linear(x, weight, bias)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]: the same as of logits.float()
    return torch.topk(probs, moe.top_k, dim=-1)


def grouped_choice(
    x: torch.Tensor, weight: torch.Tensor, selection_bias: torch.Tensor | None, moe: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited routers, in float32: -> indices [T, k], weights [T, k] (float32).

    sigmoid_group (V3, GLM-4.5): sigmoid scores; `selection_bias` [E] added for the choice only; a
    group's rank is the sum of its two best biased scores. softmax_group (V2): softmax scores; a
    group's rank is its best score. Experts outside the `topk_group` best groups are never chosen;
    the chosen experts' unbiased scores, renormalised when `norm_topk`, are scaled by `routed_scaling`."""
    logits = F.linear(x.float(), weight.float())  # [T, E]
    sigmoid = moe.router == "sigmoid_group"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores + selection_bias.float().reshape(-1) if sigmoid and selection_bias is not None else scores
    if moe.n_group > 1:
        grouped = choice.view(choice.shape[0], moe.n_group, -1)  # [T, G, E / G]
        group_rank = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.amax(dim=-1)  # [T, G]
        groups = torch.topk(group_rank, moe.topk_group, dim=-1)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        outside = ~keep[:, :, None].expand_as(grouped).reshape_as(choice)  # [T, E]
        choice = choice.masked_fill(outside, float("-inf") if sigmoid else 0.0)
    indices = torch.topk(choice, moe.top_k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, indices)  # [T, k]
    if moe.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return indices, weights * moe.routed_scaling


def group_by_expert(indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs by expert: one stable sort instead of a mask per expert."""
    rows, scales, counts = sort_by_expert(indices, weights, num_experts)
    return split_by_expert(indices, weights, rows, scales, counts.tolist())


def sort_by_expert(
    indices: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half, no host sync: -> token rows [T * k] and scales [T * k] sorted by expert,
    tokens per expert [E]. The counts are an `index_add_` of ones, not `torch.bincount`: on CUDA
    bincount reads its input's min and max back to the host to size its output
    (aten/src/ATen/native/cuda/SummaryOps.cu, `_bincount_cuda_template`), a stream synchronize on the
    gate's launching thread, which under CUDA's default scheduling spins (the H200 run 4's compute
    lane: ~90% of every link-bound step)."""
    flat = indices.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # [T * k]
    rows = order // indices.shape[1]  # [T * k] token row of each sorted pair
    counts = flat.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat))  # [E]
    return rows, weights.take(order), counts


def split_by_expert(
    indices: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, counts: list[int]
) -> Routing:
    """The host half: the experts with tokens, where each one's rows begin and how many (no kernel:
    each expert's views of the sorted rows and scales are split when first read)."""
    sizes = dict(zip(compress(range(len(counts)), counts), compress(counts, counts), strict=True))  # no 0s
    starts = dict(zip(sizes, accumulate(sizes.values(), initial=0), strict=False))  # the last sum left out
    return Routing(indices, weights, tuple(sizes), rows, scales, starts, sizes)
