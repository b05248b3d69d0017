"""Expert FFNs on the CPU from int8 / int4 weights as they are packed: cpu_packed.c, built on first use.

Under a packed expert format (`--expert-format int8|int4|hqq4`) the host keeps the routed experts
quantized (flowmoe/model/quantized.py); this computes a few rows of such an expert (<= MAX_ROWS) reading
those bytes directly, with the gate/up projections fused with the activation as cpu_expert.c does for
bf16 / fp32 weights. Formats: "int8" (an int8 per weight, a float32 scale per output row) and "int4"
(two 4-bit levels per byte, a float16 scale and zero per group of a row's columns; the group a
multiple of GROUP_STEP). x and the output in fp32 or bf16 (the model's dtype). As llama.cpp's Q8_0
does, the kernel quantizes each row of x, and of the activation between the projections, to int8
per block of 32 values (one scale max |x| / 127 each) and multiplies in exact integer sums, taken to
fp32 once per block: the result is the dequantized weights times those quantized activations (each
value off by at most its block's max |x| / 254), summed in one order whatever the rows, threads and
block (cpu_packed.c's header: the portable and AVX2 blocks give the same bits).

The block is chosen as cpu_expert.py chooses its own (`cpu_expert.isa()`, FLOWMOE_CPU_ISA): the AVX2 +
FMA + F16C intrinsics of cpu_packed_avx2.c on a CPU with them but no AVX-512, else the portable C
block.
Without the compiled library (no compiler, a non-x86 host, FLOWMOE_CPU_KERNELS=0) `fits` says no and
the caller dequantizes in torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert, native

MAX_ROWS = 32  # as cpu_expert: beyond it the GEMM is compute-bound and a dequantized matmul wins
GROUP_STEP = 64  # cpu_packed.c's SB: an int4 group is whole superblocks of 64 columns (32 bytes)
FORMATS = {"int8": 0, "int4": 1}  # cpu_packed.c's `fmt`

# (q, scale, zero): int8 q [R, C] int8, scale [R] or [R, 1] float32, zero None;
# int4 q [R, ceil(C / 2)] uint8, scale and zero [R, ceil(C / group)] float16
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# (gate [I, hidden], up [I, hidden], down [hidden, I], gate_up_bias [2I] | None, down_bias [hidden] | None)
PackedFFN = tuple[Projection, Projection, Projection, torch.Tensor | None, torch.Tensor | None]

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_PP, _PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


def kernel() -> Callable[..., int] | None:
    """flowmoe_packed_ffn_group, or None (see native.function)."""
    return native.function(
        "flowmoe_packed_ffn_group",
        (_I, _PP, _PI, _L, _L, _I, _L, _PP, _PP, _PP, _I, _F, _F, _I, _P, _I, _I),  # ..., isa, threads
        _I,
    )


def isa() -> str:
    """The block this CPU runs: `cpu_expert.isa()`, where "avx2" also needs F16C (the groups' float16
    scales and zeros), else "portable"."""
    chosen = cpu_expert.isa()
    return chosen if chosen != "avx2" or "f16c" in native.cpu_flags() else "portable"


def _projection_fits(p: Projection, fmt: str, rows: int, cols: int, group: int) -> bool:
    q, scale, zero = p
    if not (q.is_cpu and q.is_contiguous() and scale.is_contiguous()):
        return False
    if fmt == "int8":
        return q.dtype is torch.int8 and q.shape == (rows, cols) and scale.dtype is torch.float32 \
            and scale.numel() == rows and zero is None  # fmt: skip
    groups = -(-cols // group)
    return (
        q.dtype is torch.uint8
        and q.shape == (rows, -(-cols // 2))
        and zero is not None
        and zero.is_contiguous()
        and scale.dtype is torch.float16
        and zero.dtype is torch.float16
        and scale.shape == zero.shape == (rows, groups)
    )


def fits(x: torch.Tensor, ffn: PackedFFN, fmt: str, group: int) -> bool:
    """Whether `swiglu_group` takes x [n, hidden] (1 <= n <= MAX_ROWS, fp32 or bf16 on the CPU, no
    autograd) through `ffn` in `fmt` ("int8", or "int4" at `group` columns per group)."""
    gate, up, down, gate_up_bias, down_bias = ffn
    if not (
        x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.is_cpu
        and not (torch.is_grad_enabled() and x.requires_grad)
        and fmt in FORMATS
        and (fmt == "int8" or (group > 0 and group % GROUP_STEP == 0))
        and kernel() is not None
    ):
        return False
    hidden, inter = x.shape[1], gate[0].shape[0]
    projections = ((gate, inter, hidden), (up, inter, hidden), (down, hidden, inter))
    return all(_projection_fits(p, fmt, rows, cols, group) for p, rows, cols in projections) and all(
        b is None or (b.is_cpu and b.shape == (size,))
        for b, size in ((gate_up_bias, 2 * inter), (down_bias, hidden))
    )


def swiglu_group(
    xs: list[torch.Tensor],
    ffns: list[PackedFFN],
    fmt: str,
    group: int,
    moe: MoESpec,
    block: str | None = None,
) -> list[torch.Tensor]:
    """xs[e] [n_e, hidden] through ffns[e] -> [n_e, hidden] each, in x's dtype (views of one output
    buffer), in one call. Every (x, ffn) must `fits` at `fmt` and `group`, and all share one shape
    and x's dtype; `block`: one of cpu_expert.ISAS the CPU runs (default `isa()`)."""
    run = kernel()
    assert run is not None
    hidden, inter = xs[0].shape[1], ffns[0][0][0].shape[0]
    rows = [x.contiguous() for x in xs]  # each [n_e, hidden]
    counts = [r.shape[0] for r in rows]
    outs = torch.empty(sum(counts), hidden, dtype=xs[0].dtype)  # [sum n_e, hidden]: the kernel writes it
    pointers = [t.data_ptr() if t is not None else None for f in ffns for p in f[:3] for t in p]
    biases = [[None if b is None else b.float().contiguous() for b in f[3:]] for f in ffns]  # kept alive
    status = run(
        len(rows),
        native.pointers([r.data_ptr() for r in rows]),
        (ctypes.c_int * len(rows))(*counts),
        hidden,
        inter,
        FORMATS[fmt],
        group,
        native.pointers(pointers),
        native.pointers([None if b[0] is None else b[0].data_ptr() for b in biases]),
        native.pointers([None if b[1] is None else b[1].data_ptr() for b in biases]),
        int(moe.activation == "clamped_swiglu"),
        moe.swiglu_alpha,
        moe.swiglu_limit,
        int(xs[0].dtype == torch.bfloat16),
        outs.data_ptr(),
        cpu_expert.ISAS[block or isa()],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("swiglu_group (packed): no memory for the kernel's fp32 buffers")
    return list(outs.split(counts))
