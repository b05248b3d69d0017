"""Rotary embeddings of a step's query and key heads in one C call (cpu_rope.c, built with the other
kernels by `native.library()`), the floats of rope.py's torch form (a roll, two products and a sum:
four operations per layer, ~5-10 us each at a decode step's few tokens) bit for bit, on the CPU
in fp32 and bf16.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from flowmoe.kernels import native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def kernel() -> Callable[..., None] | None:
    """flowmoe_rope, or None (see native.function)."""
    return native.function("flowmoe_rope", (_P, _L, _L, _L, _L, _L, _P, _P, _I, _P))


def inplace_kernel() -> Callable[..., None] | None:
    """flowmoe_rope_inplace, or None (see native.function)."""
    return native.function("flowmoe_rope_inplace", (_P, _L, _L, _L, _L, _L, _P, _P, _I))


def fits(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether `rotate` takes x [T, heads, R] with cos and signed_sin [T, 1, R]: host tensors of one
    dtype, fp32 or bf16, every dim of x rotated, x's last dimension and the tables contiguous, no
    autograd."""
    dtype = x.dtype
    return (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and x.is_cpu  # `is_cpu`: no device object made (asked at every layer, with the caches cold)
        and x.dim() == 3
        and cos.dtype is dtype
        and signed_sin.dtype is dtype
        and cos.shape == signed_sin.shape == (x.shape[0], 1, x.shape[2])
        and x.shape[2] % 2 == 0
        and x.stride(2) == 1
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and kernel() is not None
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, R] -> x * cos + x.roll(R // 2, dims=-1) * signed_sin [T, heads, R] (where `fits`)."""
    run = kernel()
    assert run is not None
    tokens, heads, rotary = x.shape
    out = torch.empty(tokens, heads, rotary, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    ld_t, ld_h = x.stride(0), x.stride(1)
    run(
        x.data_ptr(),
        tokens,
        heads,
        rotary,
        ld_t,
        ld_h,
        cos.data_ptr(),
        signed_sin.data_ptr(),
        bf16,
        out.data_ptr(),
    )
    return out


def fits_inplace(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether `rotate_` takes x [T, heads, D] with cos and signed_sin [T, 1, R], R <= D: as `fits`,
    a partial rotary (R < D) included."""
    dtype = x.dtype
    return (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and x.is_cpu  # `is_cpu`: no device object made (asked at every layer, with the caches cold)
        and x.dim() == 3
        and cos.dtype is dtype
        and signed_sin.dtype is dtype
        and cos.shape == signed_sin.shape
        and cos.shape[0] == x.shape[0]
        and cos.shape[1] == 1
        and cos.shape[2] % 2 == 0
        and cos.shape[2] <= x.shape[2]
        and x.stride(2) == 1
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and inplace_kernel() is not None
    )


def rotate_(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """x [T, heads', D]'s first `heads` heads, the first R dims of each, rotated in place: the floats
    of `rotate` (where `fits_inplace`, heads <= heads')."""
    run = inplace_kernel()
    assert run is not None and 0 <= heads <= x.shape[1]
    tokens = x.shape[0]
    bf16 = int(x.dtype == torch.bfloat16)
    run(x.data_ptr(), tokens, heads, cos.shape[2], x.stride(0), x.stride(1), cos.data_ptr(),
        signed_sin.data_ptr(), bf16)  # fmt: skip
