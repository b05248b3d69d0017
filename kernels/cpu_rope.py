"""Rotary embeddings of a step's query and key heads in one C call (cpu_rope.c, built with the other
kernels by `native.library()`), the floats of rope.py's torch form (a roll, two products and a sum:
four operations per layer, ~5-10 us each at a decode step's few tokens) bit for bit, on the CPU
in fp32 and bf16.
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.kernels import native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


kernel = native.Kernel("flowmoe_rope", (_P, _L, _L, _L, _L, _L, _P, _P, _I, _P))  # or None
inplace_kernel = native.Kernel("flowmoe_rope_inplace", (_P, _L, _L, _L, _L, _L, _P, _P, _I))  # or None

# cos and signed_sin [T, 1, R] as the kernels take them: (dtype, T, R, their addresses)
Tables = tuple[torch.dtype, int, int, int, int]


def tables(cos: torch.Tensor, signed_sin: torch.Tensor) -> Tables | None:
    """cos and signed_sin [T, 1, R] as the kernels take them, or None where they do not: contiguous host
    tensors of one dtype, fp32 or bf16, of one shape, R even. A step's tables are checked once (a
    `Rotary` keeps them), its layers' heads at each call."""
    dtype = cos.dtype
    if (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and signed_sin.dtype is dtype
        and cos.is_cpu
        and signed_sin.is_cpu
        and cos.dim() == 3
        and cos.shape == signed_sin.shape
        and cos.shape[1] == 1
        and cos.shape[2] % 2 == 0
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
    ):
        return dtype, cos.shape[0], cos.shape[2], cos.data_ptr(), signed_sin.data_ptr()
    return None


def rotated(x: torch.Tensor, rotary: Tables) -> torch.Tensor | None:
    """x [T, heads, R] -> x * cos + x.roll(R // 2, dims=-1) * signed_sin [T, heads, R] in one C call, or
    None where the kernel does not take x with the tables `rotary`: a host tensor of their dtype and
    rows, every dim rotated, a unit last stride, no autograd."""
    run = kernel()
    if run is None or not _takes(x, rotary) or x.shape[2] != rotary[2]:
        return None
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    bf16 = int(rotary[0] is torch.bfloat16)
    ld_t, ld_h = x.stride(0), x.stride(1)
    run(x.data_ptr(), tokens, heads, dim, ld_t, ld_h, rotary[3], rotary[4], bf16, out.data_ptr())
    return out


def rotate_(x: torch.Tensor, heads: int, rotary: Tables) -> bool:
    """x [T, heads', D]'s first `heads` heads (heads <= heads'), the first R dims of each, rotated in
    place with the tables `rotary` [T, 1, R], R <= D, the floats of `rotated`, in one C call where the
    kernel takes x (-> True; else False, x as it was): as `rotated`, a partial rotary (R < D) included."""
    run = inplace_kernel()
    if run is None or not _takes(x, rotary) or x.shape[2] < rotary[2]:
        return False
    assert 0 <= heads <= x.shape[1]
    bf16 = int(rotary[0] is torch.bfloat16)
    run(x.data_ptr(), rotary[1], heads, rotary[2], x.stride(0), x.stride(1), rotary[3], rotary[4], bf16)
    return True


def _takes(x: torch.Tensor, rotary: Tables) -> bool:
    """Whether x [T, heads, D] is a host tensor of the tables' dtype and rows, a unit last stride, no
    autograd (the kernels' own check of D against R apart)."""
    return (
        x.dtype is rotary[0]
        and x.is_cpu  # `is_cpu`: no device object made (asked at every layer, with the caches cold)
        and x.dim() == 3
        and x.shape[0] == rotary[1]
        and x.stride(2) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
    )
