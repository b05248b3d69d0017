"""RMSNorm rows in one C call (cpu_norm.c, built with the other kernels by `native.library()`),
giving torch's composite floats bit for bit, for fp32 and bf16 on the CPU.

torch dispatches RMSNorm as ~13 operations, ~30-45 us for a decode step's 1024-wide row on a 2-vCPU
AMD EPYC (AVX2), most of it per-operation cost; a decode step runs two norms per layer. The C sum
of squares follows torch's CPU reduction order for the Vectorized<float> width its sum kernel
runs (SUM_WIDTH), so both paths give the same floats (tests/test_step_ops.py, tests/test_cpu_norm.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from flowmoe.kernels import native

_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
GRAIN = 32768  # at::internal::GRAIN_SIZE: from this many elements torch may split one row's sum among threads


def kernel() -> Callable[..., None] | None:
    """flowmoe_add_rms_norm (a residual added first, or none), or None (see native.function)."""
    return native.function("flowmoe_add_rms_norm", (_P, _P, _L, _L, _P, _I, _D, _I, _P, _I))


# Floats per Vectorized<float> in the sum kernel torch runs on any x86 host: 8 (32-byte vectors) with
# the AVX2 and the default capability, and 8 on AVX-512 hosts too, where aten's SumKernel.cpp registers
# sum_stub with REGISTER_DISPATCH, which leaves the AVX-512 slot empty ("these kernels are slower with
# AVX512 than with AVX2"), so the dispatcher runs the AVX2 kernel. Seen on an Intel Xeon with AVX-512
# (the H200 machine, torch 2.11.0, 2026-11-28): 16 lanes there gave other floats than torch's sum.
SUM_WIDTH = 8


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x [..., dim] with weight [dim]: host tensors of one dtype, fp32 or
    bf16, contiguous, dim < GRAIN (torch's order for one row then depends on its threads), no
    autograd."""
    dtype = x.dtype
    return (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and weight.dtype is dtype
        and x.is_cpu  # `is_cpu`: no device object made (asked twice a layer, with the caches cold)
        and weight.is_cpu
        and weight.dim() == 1
        and x.dim() > 0
        and weight.shape[0] == x.shape[-1] < GRAIN
        and x.is_contiguous()
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and kernel() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the mean
    in fp32, [..., dim] in x's dtype (where `fits`)."""
    return _normed(x, None, weight, eps)


def fits_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes x and residual [..., dim]: `fits(x, weight)`, and residual a
    contiguous host tensor of x's shape and dtype, no autograd."""
    return (
        residual.is_cpu
        and residual.dtype is x.dtype
        and residual.shape == x.shape
        and residual.is_contiguous()
        and not (torch.is_grad_enabled() and residual.requires_grad)
        and fits(x, weight)
    )


def add_rms_norm(out: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out += residual in place (out, residual: [..., dim], one dtype and shape, contiguous), then
    `rms_norm` of that sum -> [..., dim]: the floats of `rms_norm(out + residual)` in one C call and
    one allocation, where `fits_add(out, residual, weight)`."""
    return _normed(out, residual, weight, eps)


def _normed(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., dim] -> [..., dim], residual (None: none) first added into x in place."""
    run = kernel()
    assert run is not None
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    normed = torch.empty_like(x)
    bf16 = int(x.dtype == torch.bfloat16)
    # one thread below torch's grain (a decode step's few rows): waking the team for ~1 us of work per
    # row costs more than the row (the threads share out whole rows, so the floats are the same)
    threads = torch.get_num_threads() if rows * dim >= GRAIN else 1
    added = residual.data_ptr() if residual is not None else None
    run(
        x.data_ptr(),
        added,
        rows,
        dim,
        weight.data_ptr(),
        bf16,
        eps,
        SUM_WIDTH,
        normed.data_ptr(),
        threads,
    )
    return normed
