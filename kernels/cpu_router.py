"""The host half of a softmax-then-top-k router ("softmax_topk": Mixtral, Qwen-MoE, OLMoE, ...) for
a step's tokens on the CPU in one C call (cpu_router.c, built with the other kernels by
`native.library()`): the chosen probabilities renormalised and cast, the (token, slot) pairs sorted
by expert, and each expert's count, the floats and order of router.py's torch operations.

A decode step routes a handful of tokens per layer, where torch's ~10 operations for this cost
~5-10 us each, more with caches cold after the experts' weights streamed through.
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_norm, native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


kernel = native.Kernel("flowmoe_route_tail", (_L, _I, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P))  # or None


def fits(x: torch.Tensor, moe: MoESpec) -> bool:
    """Whether `tail` finishes routing x [T, hidden]: a softmax_topk router on the CPU, fp32 or bf16."""
    return (
        moe.router == "softmax_topk"
        and x.is_cpu  # no device object made
        and (x.dtype is torch.float32 or x.dtype is torch.bfloat16)
        and kernel() is not None
    )


def tail(
    top: torch.Tensor, indices: torch.Tensor, moe: MoESpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """top [T, k] float32 (each token's top-k probabilities), indices [T, k] int64 (their experts) ->
    (weights [T, k]: top renormalised where moe.norm_topk, in `dtype` unless moe.combine_fp32;
    token rows [T * k] and their weights [T * k], sorted by expert; tokens per expert [E])."""
    run = kernel()
    assert run is not None
    top, indices = top.contiguous(), indices.contiguous()
    tokens, k = top.shape
    out = torch.float32 if moe.combine_fp32 else dtype
    weights = torch.empty(tokens, k, dtype=out)  # [T, k]
    rows = torch.empty(tokens * k, dtype=torch.int64)  # [T * k]
    scales = torch.empty(tokens * k, dtype=out)  # [T * k]
    counts = (ctypes.c_int64 * moe.experts)()
    bf16 = int(out == torch.bfloat16)
    norm, width = int(moe.norm_topk), cpu_norm.SUM_WIDTH
    run(
        tokens, k, moe.experts, top.data_ptr(), indices.data_ptr(), norm, width,
        bf16, weights.data_ptr(), rows.data_ptr(), scales.data_ptr(), counts,
    )  # fmt: skip
    return weights, rows, scales, list(counts)
