"""Linear projections in the fastest form the CPU has for their shape.

* A few rows (a decode step's tokens, the tokens one expert gets; in bf16 where torch has native
  bf16 matmuls, up to cpu_expert.max_rows: one row with the portable block, more with the AVX2 and
  AVX-512 ones): cpu_expert.c, which reads the weight once at
  memory speed (see kernels/cpu_expert.py); with its AVX2 or AVX-512 block up to AVX2_MAX_ROWS in
  fp32 (a prefill's projections), where its register tiles keep up with torch's GEMM (`max_rows`).
* Up to a few hundred rows otherwise: (w @ x.T).T, which MKL (fp32) and oneDNN (bf16 on a CPU
  with AVX512-BF16 / AMX) run faster than x @ w.T. Measured in one run on the 2-vCPU Xeon with
  AMX of issue 15, one thread, a [14336, 2048] weight streamed from memory: fp32 at 32-64 rows
  5.8 vs 4.3 GB/s; bf16 at 2-16 rows 13.6-14.2 vs 10.7-10.8 GB/s (F.linear). On a 2-core AVX2
  EPYC, fp32 at 4 rows: 1.3 ms vs 3.4 ms as x @ w.T. The fast kernel wants x row-major
  (x.t() a transposed view), so an x that is itself a transposed view is copied first.
  Past TILE_ROWS rows only a multiple of TILE_ROWS (`rows_as_columns`): there x's rows are the
  GEMM's columns, and a count of columns short of the libraries' 16-wide tiles runs their tail
  code. An expert's FFN (gate/up [7168, 1024], down [1024, 3584]) on the 2-vCPU AMD EPYC Zen 4,
  1 thread, 7 alternated rounds, GFLOPS as (w @ x.T).T against x @ w.T: bf16 17 rows 54 vs 99, 24
  76 vs 116, 31 96 vs 128, 33 123 vs 135, 72 150 vs 174, 88 143 vs 180; at multiples of 16: 32 169
  vs 131, 48 178 vs 155, 64 173 vs 154, 96 196 vs 185, 128 199 vs 192; fp32 229 61 vs 84, 136 73
  vs 77, 192 87 vs 84 (a prefill's experts get any count of rows). bf16 rows past TILE_ROWS
  that are not whole tiles are padded with zero rows to a multiple of PAD_ROWS (their products
  dropped), taken as (W @ x.T).T where that is whole tiles and as x @ W.T otherwise: oneDNN makes
  and keeps a primitive (JIT code and buffers: 74 new mappings of ~350 KB after one prompt) for
  every shape it meets, and an expert's
  rows take any count, so a batch job's resident memory grew with every prompt (issue 25's bf16
  checkpoint, random prompts of 40-300 tokens, 1 thread: 1.88 -> 2.33 GiB over 200 prompts, still
  growing). Padded to whole tiles of 16 the time for a 128-token prefill grew 7% (b1); in eighths,
  on an expert's shapes (1 thread, gate_up and down, 14 counts of 17-120 rows): 88.1 ms in all,
  unpadded 88.2, in sixteenths 89.1 (x @ W.T past 16 rows at an odd multiple of 8, the transposed
  form at whole tiles: the faster of the two at each); end to end 4-6% (b1, 5 alternated runs).
  torch's ideep layer keeps a cache of its own over those primitives (LRU_CACHE_CAPACITY entries,
  1024 by default, read when first used): capped at IDEEP_CACHE unless the user set it. Both:
  1.72 -> 1.79 GiB over 100 prompts at the same CPU time (bench/rss_growth.py).
* bf16 / fp16 with many rows (prefill) on a CPU without native half-precision matmul
  (no AVX512-BF16 / AMX): the half-precision GEMM is emulated and compute-bound,
  about 4x slower than widening the operands to fp32, multiplying there, and rounding
  the product back (both accumulate in fp32; the product is rounded once either way).

Elsewhere (CUDA, fp16, emulated half precision with few rows, many rows) it is F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flowmoe.kernels import cpu_expert

FEW_ROWS = 256  # up to this many rows the transposed form is the faster one on the CPU (fp32, bf16)
TILE_ROWS = 16  # the GEMM libraries' tile across W @ x.T's columns (x's rows)
WIDEN_ROWS = 32  # from this many rows an emulated half-precision GEMM is slower than widening
PAD_ROWS = 8  # bf16 rows past a tile go to oneDNN in multiples of this (the module's notes)
IDEEP_CACHE = 16  # entries of ideep's cache of oneDNN computations (the module's notes)

os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_CACHE))  # before the first bf16 GEMM reads it


_emulated = cpu_expert.emulated  # whether torch's matmuls in a dtype are emulated here


def rows_as_columns(rows: int) -> bool:
    """Whether `rows` rows take the transposed form (W @ x.T).T on the CPU (the module's notes): up to
    TILE_ROWS, or up to FEW_ROWS in whole tiles."""
    return rows <= TILE_ROWS or (rows <= FEW_ROWS and rows % TILE_ROWS == 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [n, in], weight: [out, in], bias: [out] -> [n, out] (a transposed view for few rows)."""
    if not x.is_cpu or x.dim() != 2:  # `is_cpu`: no device object made
        return F.linear(x, weight, bias)
    if cpu_expert.fits(x, weight, bias):
        return cpu_expert.linear_rows(x, weight, bias)
    rows = x.shape[0]
    if rows >= WIDEN_ROWS and _emulated(x.dtype):
        wide_bias = bias.float() if bias is not None else None
        return linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    if x.dtype not in (torch.float32, torch.bfloat16) or _emulated(x.dtype):
        return F.linear(x, weight, bias)
    if not rows_as_columns(rows):
        if x.dtype != torch.bfloat16 or rows > FEW_ROWS:
            return F.linear(x, weight, bias)
        padded = x.new_zeros(-(-rows // PAD_ROWS) * PAD_ROWS, x.shape[1])  # [whole, in]
        padded[:rows] = x
        whole = linear if rows_as_columns(padded.shape[0]) else F.linear  # whole tiles: the transposed form
        return whole(padded, weight, bias)[:rows]  # [n, out]
    out = torch.matmul(weight, x.contiguous().t()).t()  # [n, out]
    return out if bias is None else out + bias
