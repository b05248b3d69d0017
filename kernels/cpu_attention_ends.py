"""The host kernels on either side of a layer's attention, each side in one C call
(cpu_attention_ends.c): PRE_ATTN's RMSNorm, q/k/v projection and rope, POST_ATTN's o projection,
residual add and RMSNorm.

Taken only where each kernel of the chain would take its part on its own (cpu_norm.takes,
cpu_expert.fits, the rope tables of the step): the same kernels then run in the same order, so the
floats are those of the separate calls; elsewhere None, and the caller runs them one by one (each
to its own fallback). A decode step's kernel calls, each between kernels that stream the weights
through the caches, cost 10-20 us of Python and ctypes apiece (issue 25's profile): three calls
become one before attention, two after it.
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.kernels import cpu_expert, cpu_norm, native
from flowmoe.kernels.rope import Rotary

_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double

pre_kernel = native.Kernel(
    "flowmoe_pre_attention",
    (_P, _L, _L, _P, _D, _I, _I, _P, _I, _L, _P, _P, _L, _L, _L, _P, _P, _I, _I),
    _I,
)  # or None
post_kernel = native.Kernel(
    "flowmoe_post_attention", (_P, _L, _L, _L, _P, _I, _L, _P, _P, _P, _D, _I, _I, _P, _P, _I, _I), _I
)  # or None


def pre_attention(
    hidden: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rope: Rotary,
    heads: int,
    head_dim: int,
) -> torch.Tensor | None:
    """hidden [T, H] -> qkv [T, O] = RMSNorm(hidden, norm) @ weight [O, H]^T (+ bias [O]), each row's
    first `heads` heads of `head_dim` rotated by `rope` (its first R dims), in one call; None where a
    kernel of the chain would not take its part."""
    run, facts = pre_kernel(), cpu_norm.takes(hidden, None, norm)
    tables = rope.tables
    if (
        run is None
        or facts is None
        or hidden.dim() != 2
        or not cpu_expert.fits(hidden, weight, bias)  # the normed rows: hidden's dtype, shape and device
        or tables is None
        or tables[0] is not hidden.dtype
        or tables[1] != hidden.shape[0]
        or tables[2] > head_dim
        or weight.shape[0] < heads * head_dim
    ):
        return None
    rows, width = hidden.shape
    outs = weight.shape[0]
    qkv = torch.empty(rows, outs, dtype=hidden.dtype)  # [T, O]: the kernel writes it
    wide = cpu_expert.wide_bias(bias)
    status = run(
        hidden.data_ptr(), rows, width, facts[2], eps, cpu_norm.SUM_WIDTH, cpu_norm.threads_for(rows, width),
        weight.data_ptr(), int(weight.dtype == torch.bfloat16), outs, cpu_expert.address(wide),
        qkv.data_ptr(), heads, tables[2], head_dim, tables[3], tables[4], cpu_expert.ISAS[cpu_expert.isa()],
        torch.get_num_threads(),
    )  # fmt: skip
    cpu_expert.check(status, "pre_attention")
    return qkv


def post_attention(
    attn: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """attn [T, K] -> (residual + attn @ weight [H, K]^T (+ bias [H]), its RMSNorm with `norm`) [T, H]
    each, in one call; None where a kernel of the chain would not take its part."""
    run = post_kernel()
    if run is None or attn.dim() != 2 or residual.dim() != 2 or not cpu_expert.fits(attn, weight, bias):
        return None
    rows, outs = attn.shape[0], weight.shape[0]
    total = torch.empty(rows, outs, dtype=attn.dtype)  # [T, H]: the projection's output, then the sum
    facts = cpu_norm.takes(total, residual, norm)
    if facts is None:
        return None
    normed = torch.empty_like(total)  # [T, H]
    rows_of_attn, wide = cpu_expert.unit_rows(attn), cpu_expert.wide_bias(bias)
    status = run(
        rows_of_attn.data_ptr(), rows_of_attn.stride(0), rows, attn.shape[1], weight.data_ptr(),
        int(weight.dtype == torch.bfloat16), outs, cpu_expert.address(wide), residual.data_ptr(), facts[2],
        eps, cpu_norm.SUM_WIDTH, cpu_norm.threads_for(rows, outs), total.data_ptr(), normed.data_ptr(),
        cpu_expert.ISAS[cpu_expert.isa()], torch.get_num_threads(),
    )  # fmt: skip
    cpu_expert.check(status, "post_attention")
    return total, normed
