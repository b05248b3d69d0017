"""Group-wise int4 dequantization on the GPU: one Triton kernel launch per projection, reading the
packed bytes, scales and zeros (model/quantized.py, `Int4Weight`) and writing the model's dtype
straight into the buffer it is given, with no float32 temporaries in memory.

Each value is the torch path's, bit for bit: the nibble (column 2j low, 2j + 1 high) and its group's
float16 zero and scale in float32, (q - zero) x scale rounded once each, then rounded to nearest
even into bfloat16 by integer arithmetic on the float32 bits (as c10's `round_to_nearest_even` and
the GPU's cvt.rn do; Triton's interpreter truncates a plain `.to(bfloat16)`), or by `.to` into
float16 and float32. Imported where `triton` imports (CUDA builds of torch bring it); under
`TRITON_INTERPRET=1` the same kernel runs in Triton's interpreter on CPU tensors, as the tests check
it (tests/test_int4_triton.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

COLUMNS_PER_PROGRAM = 1024  # the widest tile's columns (a power of two)
VALUES_PER_PROGRAM = 4096  # a tile's rows x columns


def _dequantize_int4(
    packed,  # uint8 [R, ceil(C / 2)]
    scale,  # float16 [R, G]
    zero,  # float16 [R, G]
    out,  # [R, C]: float16, float32, or bfloat16 viewed as uint16
    rows,
    columns,
    packed_row,  # row strides, in elements
    group_row,
    out_row,
    GROUP: tl.constexpr,  # columns per scale and zero
    BF16: tl.constexpr,  # out holds bfloat16's bits
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]  # [BLOCK_R, 1]
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]  # [1, BLOCK_C]
    inside = (r < rows) & (c < columns)  # [BLOCK_R, BLOCK_C]
    byte = tl.load(packed + r * packed_row + c // 2, mask=inside, other=0)
    q = ((byte >> ((c % 2) * 4)) & 0x0F).to(tl.float32)
    at = r * group_row + c // GROUP
    z = tl.load(zero + at, mask=inside, other=0).to(tl.float32)
    s = tl.load(scale + at, mask=inside, other=0).to(tl.float32)
    w = (q - z) * s  # [BLOCK_R, BLOCK_C] float32
    if BF16:
        bits = w.to(tl.uint32, bitcast=True)
        w = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    tl.store(out + r * out_row + c, w.to(out.dtype.element_ty), mask=inside)


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The kernel, jitted, or wrapped for the interpreter: triton.jit reads TRITON_INTERPRET when it
    wraps a function, so each setting gets its own."""
    return triton.jit(_dequantize_int4)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, out: torch.Tensor
) -> None:
    """packed uint8 [R, ceil(C / 2)], scale and zero float16 [R, ceil(C / group)] -> `out` [R, C]
    (bfloat16, float16 or float32; rows with a unit column stride, a view of a larger buffer too),
    in one launch on the current stream."""
    rows, columns = out.shape
    assert out.stride(1) == packed.stride(1) == scale.stride(1) == zero.stride(1) == 1
    assert scale.stride(0) == zero.stride(0)
    bf16 = out.dtype == torch.bfloat16
    block_c = min(COLUMNS_PER_PROGRAM, triton.next_power_of_2(columns))
    block_r = VALUES_PER_PROGRAM // block_c
    grid = (triton.cdiv(rows, block_r), triton.cdiv(columns, block_c))
    _kernel(bool(triton.knobs.runtime.interpret))[grid](
        packed,
        scale,
        zero,
        out.view(torch.uint16) if bf16 else out,
        rows,
        columns,
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group,
        BF16=bf16,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        enable_fp_fusion=False,  # (q - zero) x scale rounded twice, as torch does
    )
