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
block (cpu_packed.c's header: the portable, AVX2 and AVX-512 blocks give the same bits).

The block is chosen by the CPU's flags at run time (`isa`): cpu_packed_avx512.c's (the AVX2 block's
tiles with AVX512-VNNI's integer dot products) on a CPU with AVX-512 F/BW/VL/DQ and VNNI, else the
AVX2 + FMA + F16C intrinsics of cpu_packed_avx2.c on a CPU with them, else the portable C block;
FLOWMOE_CPU_ISA names one where the CPU runs it. On a Zen 4 (1 thread, bench/packed_rows.py, one
1024 x 3584 expert from DRAM, 9 alternated rounds, load 4) the AVX-512 block against the AVX2 one:
int8 1 row 1.03x, 2 rows 1.06x, 8 rows 1.13x; int4 0.98x, 1.03x, 1.05x (warm, in the LLC: int8 1.03x,
1.19x, 1.20x; int4 1.00x, 0.95x, 1.07x); the portable block compiled for AVX-512 was ~10x slower (a
b1 decode step with int4 experts, attention and LM head 131 ms against 12.1 with the AVX2 block).
Without the compiled library (no compiler, a non-x86 host, FLOWMOE_CPU_KERNELS=0) `fits` says no and
the caller dequantizes in torch.
"""

from __future__ import annotations

import ctypes
import os

import torch
from attrs import frozen

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert, native

MAX_ROWS = 32  # as cpu_expert: beyond it the GEMM is compute-bound and a dequantized matmul wins
GROUP_STEP = 64  # cpu_packed.c's SB: an int4 group is whole superblocks of 64 columns (32 bytes)
FORMATS = {"int8": 0, "int4": 1}  # cpu_packed.c's `fmt`
BLOCKS = {"portable": 0, "avx2": 1, "avx512": 2}  # cpu_packed.c's `isa`
_AVX2 = frozenset({"avx2", "fma", "f16c"})
NEEDS = {  # the CPU flags (/proc/cpuinfo's names) each block runs on
    "portable": frozenset(),
    "avx2": _AVX2,
    "avx512": _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
}
DEFAULT = ("avx512", "avx2", "portable")  # the first of these the CPU runs is the default

# (q, scale, zero): int8 q [R, C] int8, scale [R] or [R, 1] float32, zero None;
# int4 q [R, ceil(C / 2)] uint8, scale and zero [R, ceil(C / group)] float16
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# (gate [I, hidden], up [I, hidden], down [hidden, I], gate_up_bias [2I] | None, down_bias [hidden] | None)
PackedFFN = tuple[Projection, Projection, Projection, torch.Tensor | None, torch.Tensor | None]

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_PP, _PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


kernel = native.Kernel(  # flowmoe_packed_ffn_group, or None
    "flowmoe_packed_ffn_group",
    (_I, _PP, _PI, _L, _L, _I, _L, _PP, _PP, _PP, _I, _F, _F, _I, _P, _I, _I),  # ..., isa, threads
    _I,
)


def isa() -> str:
    """The block this CPU runs (a key of BLOCKS): the one FLOWMOE_CPU_ISA names where the CPU has its
    flags (NEEDS; F16C for the groups' float16 scales and zeros), else the first of DEFAULT it has."""
    block = native.chosen_block(os.environ.get("FLOWMOE_CPU_ISA", ""), NEEDS, DEFAULT)
    assert block is not None, "the portable block needs no flag"
    return block


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


@frozen
class Prepared:
    """An expert as the kernel call takes it, checked once (`prepare`): its 9 weight pointers
    ((q, scale, zero) of gate, up, down; zero None for int8) and biases in fp32 (kept alive here)."""

    fmt: str
    group: int
    hidden: int
    inter: int
    pointers: tuple[int | None, ...]
    gate_up_bias: torch.Tensor | None  # [2I] float32
    down_bias: torch.Tensor | None  # [hidden] float32

    def same_kind(self, other: Prepared) -> bool:
        """Whether one kernel call takes both: one format, group and shape."""
        return self.fmt == other.fmt and self.group == other.group and self.inter == other.inter \
            and self.hidden == other.hidden  # fmt: skip


def prepare(ffn: PackedFFN, fmt: str, group: int, hidden: int) -> Prepared | None:
    """`ffn` in `fmt` ("int8", or "int4" at `group` columns per group) as `swiglu_prepared` takes it
    for rows of `hidden` columns; None where the kernel does not read it (or there is no kernel)."""
    gate, up, down, gate_up_bias, down_bias = ffn
    if fmt not in FORMATS or (fmt == "int4" and (group <= 0 or group % GROUP_STEP)) or kernel() is None:
        return None
    inter = gate[0].shape[0]
    projections = ((gate, inter, hidden), (up, inter, hidden), (down, hidden, inter))
    if not all(_projection_fits(p, fmt, rows, cols, group) for p, rows, cols in projections) or not all(
        b is None or (b.is_cpu and b.shape == (size,))
        for b, size in ((gate_up_bias, 2 * inter), (down_bias, hidden))
    ):
        return None
    pointers = tuple(None if t is None else t.data_ptr() for p in (gate, up, down) for t in p)
    biases = [None if b is None else b.float().contiguous() for b in (gate_up_bias, down_bias)]
    return Prepared(fmt, group, hidden, inter, pointers, *biases)


def takes(x: torch.Tensor, hidden: int) -> bool:
    """Whether the kernel takes x's rows: [n, hidden] fp32 or bf16 on the CPU, no autograd (at most
    MAX_ROWS rows a call: the caller's pieces)."""
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and x.shape[1] == hidden
        and x.is_cpu
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def fits(x: torch.Tensor, ffn: PackedFFN, fmt: str, group: int) -> bool:
    """Whether `swiglu_group` takes x [n, hidden] (1 <= n <= MAX_ROWS, `takes`) through `ffn` in
    `fmt` ("int8", or "int4" at `group` columns per group)."""
    hidden = x.shape[-1]
    return 0 < x.shape[0] <= MAX_ROWS and takes(x, hidden) and prepare(ffn, fmt, group, hidden) is not None


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
    and x's dtype; `block`: one of BLOCKS the CPU runs (default `isa()`)."""
    hidden = xs[0].shape[1]
    experts = [e for e in (prepare(f, fmt, group, hidden) for f in ffns) if e is not None]
    assert len(experts) == len(ffns), "an expert the kernel does not read (see fits)"
    rows = [x.contiguous() for x in xs]  # each [n_e, hidden]
    counts = [r.shape[0] for r in rows]
    out = swiglu_prepared([r.data_ptr() for r in rows], counts, experts, xs[0].dtype, moe, block)
    return list(out.split(counts))


def swiglu_prepared(
    rows: list[int],
    counts: list[int],
    experts: list[Prepared],
    dtype: torch.dtype,
    moe: MoESpec,
    block: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert e's counts[e] contiguous rows of `dtype` (fp32 or bf16) [n_e, hidden] at address
    rows[e] through experts[e] (all of one kind, `Prepared.same_kind`) -> [sum n_e, hidden] in
    `dtype`, in one call; the caller keeps the rows alive and checks them (`takes`). `out`: a
    contiguous [sum n_e, hidden] tensor of `dtype` to write (default a new one)."""
    run = kernel()
    assert run is not None
    first = experts[0]
    if out is None:
        out = torch.empty(sum(counts), first.hidden, dtype=dtype)  # [sum n_e, hidden]: the kernel writes it
    n = len(rows)
    if all(e.gate_up_bias is None and e.down_bias is None for e in experts):
        gate_up_biases = down_biases = cpu_expert.nulls(n)
    else:
        gate_up_biases = native.pointers(
            [None if e.gate_up_bias is None else e.gate_up_bias.data_ptr() for e in experts]
        )
        down_biases = native.pointers(
            [None if e.down_bias is None else e.down_bias.data_ptr() for e in experts]
        )
    status = run(
        n,
        native.pointers(rows),
        (ctypes.c_int * n)(*counts),
        first.hidden,
        first.inter,
        FORMATS[first.fmt],
        first.group,
        native.pointers([p for e in experts for p in e.pointers]),
        gate_up_biases,
        down_biases,
        int(moe.activation == "clamped_swiglu"),
        moe.swiglu_alpha,
        moe.swiglu_limit,
        int(dtype == torch.bfloat16),
        out.data_ptr(),
        BLOCKS[block or isa()],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("swiglu_group (packed): no memory for the kernel's fp32 buffers")
    return out


linear_kernel = native.Kernel(  # flowmoe_packed_linear, or None
    "flowmoe_packed_linear", (_P, _L, _L, _L, _I, _L, _PP, _P, _I, _P, _I, _I), _I
)


def linear_fits(x: torch.Tensor, weight: Projection, fmt: str, group: int, rows: int) -> bool:
    """Whether `linear` takes x [n, C] (`takes`, any n) through `weight`, a [rows, C] projection in
    `fmt` ("int8", or "int4" at `group` columns per group)."""
    if fmt not in FORMATS or (fmt == "int4" and (group <= 0 or group % GROUP_STEP)):
        return False
    cols = x.shape[-1]
    return takes(x, cols) and _projection_fits(weight, fmt, rows, cols, group) and linear_kernel() is not None


def linear(
    x: torch.Tensor,
    weight: Projection,
    fmt: str,
    group: int,
    bias: torch.Tensor | None = None,
    block: str | None = None,
) -> torch.Tensor:
    """x [n, C] through `weight` [R, C] (`linear_fits`) -> [n, R] in x's dtype: x's rows quantized per
    block as the experts' are (the module docstring), each row's outputs the same bits at any n and
    thread count; bias [R] (added in fp32 before the rounding) or None; `block` as `swiglu_group`'s."""
    run = linear_kernel()
    assert run is not None
    rows = weight[0].shape[0]
    x = x.contiguous()  # [n, C]
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)  # [n, R]: the kernel writes it
    wide_bias = None if bias is None else bias.float().contiguous()  # [R]
    status = run(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        rows,
        FORMATS[fmt],
        group,
        native.pointers([None if t is None else t.data_ptr() for t in weight]),
        None if wide_bias is None else wide_bias.data_ptr(),
        int(x.dtype == torch.bfloat16),
        out.data_ptr(),
        BLOCKS[block or isa()],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("linear (packed): no memory for the kernel's buffers")
    return out
