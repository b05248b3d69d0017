"""RMSNorm rows in one C call (cpu_norm.c, built with the other kernels by `native.library()`),
giving torch's composite floats bit for bit, for fp32 and bf16 on the CPU.

torch dispatches RMSNorm as ~13 operations, ~30-45 us for a decode step's 1024-wide row on a 2-vCPU
AMD EPYC (AVX2), most of it per-operation cost; a decode step runs two norms per layer. The C sum
of squares follows torch's CPU reduction order for the Vectorized<float> width its sum kernel
runs (SUM_WIDTH), so both paths give the same floats (tests/test_step_ops.py, tests/test_cpu_norm.py).
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.kernels import native

_P, _L, _I, _D = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
GRAIN = 32768  # at::internal::GRAIN_SIZE: from this many elements torch may split one row's sum among threads


kernel = native.Kernel("flowmoe_add_rms_norm", (_P, _P, _L, _L, _P, _I, _D, _I, _P, _I))  # or None

# Floats per Vectorized<float> in the sum kernel torch runs on any x86 host: 8 (32-byte vectors) with
# the AVX2 and the default capability, and 8 on AVX-512 hosts too, where aten's SumKernel.cpp registers
# sum_stub with REGISTER_DISPATCH, which leaves the AVX-512 slot empty ("these kernels are slower with
# AVX512 than with AVX2"), so the dispatcher runs the AVX2 kernel. Seen on an Intel Xeon with AVX-512
# (the H200 machine, torch 2.11.0, 2026-11-28): 16 lanes there gave other floats than torch's sum.
SUM_WIDTH = 8


def _weight_facts(weight: torch.Tensor) -> tuple[torch.dtype, int, int] | None:
    """A norm weight [dim] as the kernel takes it: (its dtype, dim, address), or None where it does
    not take it (not a contiguous fp32 or bf16 host vector narrower than GRAIN)."""
    dtype = weight.dtype
    if (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and weight.is_cpu
        and weight.dim() == 1
        and weight.shape[0] < GRAIN
        and weight.is_contiguous()
    ):
        return dtype, weight.shape[0], weight.data_ptr()
    return None


_weight = native.Facts(_weight_facts)  # a layer's norm weights are checked on their first call


def takes(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.dtype, int, int] | None:
    """The weight's facts (dtype, dim, address) where `normed` takes x, `residual` and weight (see
    there), else None."""
    facts = _weight(weight)
    if (
        facts is None
        or kernel() is None
        or x.dtype is not facts[0]
        or not x.is_cpu  # `is_cpu`: no device object made (asked twice a layer, with the caches cold)
        or x.dim() == 0
        or x.shape[-1] != facts[1]
        or not x.is_contiguous()
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return None
    if residual is not None and not (
        residual.is_cpu
        and residual.dtype is facts[0]
        and residual.shape == x.shape
        and residual.is_contiguous()
        and not (torch.is_grad_enabled() and residual.requires_grad)
    ):
        return None
    return facts


def threads_for(rows: int, dim: int) -> int:
    """The norm's threads: one below torch's grain (a decode step's few rows), where waking the team
    for ~1 us of work per row costs more than the row (the threads share out whole rows, so the floats
    are the same)."""
    return torch.get_num_threads() if rows * dim >= GRAIN else 1


def normed(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm of x [..., dim] with weight [dim] in one C call -> [..., dim] in x's dtype: weight *
    (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the mean in fp32; with a `residual` (x's shape and dtype,
    x a tensor of the caller's own), x += residual in place first, the floats of the norm of
    `x + residual`. None where the kernel does not take them (torch's path then): host tensors of
    one dtype, fp32 or bf16, contiguous, dim < GRAIN (torch's order for one row then depends on its
    threads), no autograd; the weight's part is checked once per weight."""
    facts = takes(x, residual, weight)
    if facts is None:
        return None
    run = kernel()
    assert run is not None  # `takes` asked
    dim = facts[1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty_like(x)
    bf16 = int(facts[0] is torch.bfloat16)
    added = None if residual is None else residual.data_ptr()
    run(
        x.data_ptr(), added, rows, dim, facts[2], bf16, eps, SUM_WIDTH, out.data_ptr(), threads_for(rows, dim)
    )
    return out
