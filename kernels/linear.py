"""Linear projections in the fastest form the CPU has for their shape.

* Few rows (a decode step's tokens, or the few tokens one expert gets): with MKL,
  x @ w.T runs a kernel several times slower than the same product asked for as
  (w @ x.T).T, which streams the weight at memory speed (measured on a 2-core AVX2
  EPYC: a [4096, 1024] fp32 weight against 4 rows, 3.4 ms as x @ w.T, 1.3 ms as
  (w @ x.T).T; equal from a few hundred rows on). The fast kernel wants x row-major
  (x.t() a transposed view), so an x that is itself a transposed view is copied first.
* bf16 / fp16 with many rows (prefill) on a CPU without native half-precision matmul
  (no AVX512-BF16 / AMX): the half-precision GEMM is emulated and compute-bound,
  about 4x slower than widening the operands to fp32, multiplying there, and rounding
  the product back (both accumulate in fp32; the product is rounded once either way).

Elsewhere (CUDA, or few half-precision rows) it is F.linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FEW_ROWS = 256  # up to this many rows the transposed form is the faster one on the CPU
WIDEN_ROWS = 32  # from this many rows an emulated half-precision GEMM is slower than widening


@functools.cache
def _emulated(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices without native instructions."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [n, in], weight: [out, in], bias: [out] -> [n, out] (a transposed view for few rows)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows >= WIDEN_ROWS and _emulated(x.dtype):
        wide_bias = bias.float() if bias is not None else None
        return linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    if rows > FEW_ROWS or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    out = torch.matmul(weight, x.contiguous().t()).t()  # [n, out]
    return out if bias is None else out + bias
