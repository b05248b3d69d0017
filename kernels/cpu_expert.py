"""The CPU's few-row projections and expert FFNs at memory speed: cpu_expert.c, built on first use.

A decode step gives each expert a few rows, so its FFN is a weight read with a little arithmetic
per byte: 2 * rows flops per fp32 weight. torch's fp32 kernels lose much of the bandwidth there
(one thread on the 2-vCPU AMX Xeon of issue 15, a [14336, 2048] weight at 16 rows: MKL's x @ w.T
reads it at 33% of the read rate, (w @ x.T).T 49%, oneDNN 54%, MKL with a prepacked weight 53%,
this kernel 60%); cpu_expert.c streams each weight once and multiplies it against every row while
it is in L1, and fuses the gate/up projections with the activation (no [n, 2I] intermediate).
Its sums run in a fixed order per output element whatever the number of rows, so an expert gives
its rows the same result however a schedule splits them. Numbers: bench/RESULTS.md (issue 15).

Which block multiplies is chosen by the CPU's features at run time (`isa`): on a CPU with AVX-512
F / BW / VL and BF16 (Zen 4, Sapphire Rapids), cpu_rows_avx512.c's intrinsics (bf16 weights against
bf16 rows with `vdpbf16ps`, no widening); else on one with AVX2 and FMA, cpu_rows_avx2.c's (the
portable block's two-register vectors are compute-bound at a quarter to a half of the read roof
there, see that file); elsewhere the portable block, compiled for the host. On a 2-vCPU AMD EPYC
Zen 4, 1 thread, CPU time, issue 25's shapes (hidden 1024, intermediate 3584, vocab 32000): the
AVX-512 block reads bf16 weights at one row at 79-90% of the read roof (the AVX2 block 59-69%),
fp32 at the AVX2 block's rate; from 2 to 16 rows it takes 0.6-0.85 of the AVX2 block's time (bf16
FFN 8 rows 36.0 against 47.3 ms, LM head 5.8 against 8.0), at 64-128 fp32 rows 1.03-1.07; a bf16
batch-1 decode step 25.9-26.3 against 28.1-31.5 ms CPU (bench/RESULTS.md, issue 25). The portable
block compiled for AVX-512 took twice the AVX2 block's time there. FLOWMOE_CPU_ISA=portable|avx2|
avx512 forces a block where the CPU runs it (for comparison, and to test each on one machine).
bf16 weights from two rows on go to oneDNN where
torch has native bf16 matmuls (AVX512-BF16 / AMX), to these kernels elsewhere (torch emulates bf16
there at a fraction of the read rate); with the AVX2 and AVX-512 blocks, up to MAX_ROWS and
AVX512_BF16_ROWS bf16 rows go to the kernels there too (a decode step's), more (a prefill's) to
oneDNN.

The C source is built with the others of this folder by `native.library()`; without it (no
compiler, a non-x86 host, FLOWMOE_CPU_KERNELS=0) every caller takes torch's path instead.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import native

# (gate_up [2I, hidden], down [hidden, I], gate_up_bias [2I] | None, down_bias [hidden] | None)
FFN = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]

MAX_ROWS = 32  # beyond this many rows the GEMM is compute-bound and MKL's blocking wins (portable block)
# cpu_rows_avx2.c's 3-row tiles against a widened chunk, from 16 rows on: at the issue-25 checkpoint's
# shapes (hidden 1024, intermediate 3584; 2-vCPU AMD EPYC, 1 thread) its expert FFN and projections
# keep up with torch's (MKL fp32; bf16 widened to fp32 first) up to 128 rows and pass them in bf16
# (bench/RESULTS.md, issue 25 prefill): a 128-token prefill's experts all go to the kernels
AVX2_MAX_ROWS = 128
# bf16 rows cpu_rows_avx512.c takes where torch's bf16 is native (oneDNN's AVX512-BF16 kernels): on
# the Zen 4 of the module's notes (1 thread, CPU time, issue 25's shapes) its expert FFN against
# oneDNN's is 1.05x at 8 rows, 0.97x at 16, 0.75x at 32; its projections 1.09-1.26x at 16, 0.91-0.99x
# at 32 (bench/RESULTS.md, issue 25)
AVX512_BF16_ROWS = 16
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_PP, _PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with this module's functions declared, or None (see native.library)."""
    lib = native.library()
    if lib is None:
        return None
    lib.flowmoe_linear.argtypes = [_P, _L, _I, _L, _P, _I, _L, _P, _P, _L, _I, _I]
    lib.flowmoe_linear.restype = _I
    lib.flowmoe_ffn_group.argtypes = [_I, _PP, _PI, _L, _L, _PP, _PP, _I, _PP, _PP, _I, _F, _F, _P]
    lib.flowmoe_ffn_group.argtypes += [_I, _I]  # isa, threads
    lib.flowmoe_ffn_group.restype = _I
    lib.flowmoe_ffn_routed.argtypes = [_I, _P, _L, _P, _PI, _L, _L, _PP, _PP, _I, _PP, _PP, _I, _F, _F]
    lib.flowmoe_ffn_routed.argtypes += [_P, _I, _P, _I, _I, _I]  # scales, bf16?, out, bf16?, isa, threads
    lib.flowmoe_ffn_routed.restype = _I
    return lib


ISAS = {"portable": 0, "avx2": 1, "avx512": 2}  # the C kernels' `isa` argument
NEEDS = {  # the CPU flags (/proc/cpuinfo's names) each block runs on
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
}
DEFAULT = ("avx512", "avx2", "portable")  # the first of these the CPU runs is the default


@functools.cache
def isa() -> str:
    """The block the kernels multiply with here: the first of DEFAULT the CPU has the flags for
    (NEEDS), or the one FLOWMOE_CPU_ISA names where the CPU runs it (else the default). Worked out at
    the first call (it is asked at every kernel call): `isa.cache_clear()` after changing FLOWMOE_CPU_ISA."""
    wanted = os.environ.get("FLOWMOE_CPU_ISA", "")
    if wanted not in ("", *ISAS):
        raise ValueError(f"FLOWMOE_CPU_ISA={wanted!r}: expected one of {', '.join(ISAS)} (or unset)")
    block = native.chosen_block(wanted, NEEDS, DEFAULT)
    assert block is not None, "the portable block needs no flag"
    return block


@functools.cache
def emulated(dtype: torch.dtype) -> bool:
    """Whether this CPU's torch multiplies `dtype` matrices without native instructions."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def max_rows(dtype: torch.dtype) -> int:
    """The most rows the kernels take in `dtype`: MAX_ROWS (AVX2_MAX_ROWS with the AVX2 and AVX-512
    blocks), but where torch's bf16 matmuls are native (oneDNN's AMX / AVX512-BF16 kernels) one bf16
    row with the portable block, MAX_ROWS with the AVX2 one and AVX512_BF16_ROWS with the AVX-512
    one: on the Zen 4 above, batch-8 bf16 decode steps took 105 ms with the AVX2 block against 232
    through oneDNN, and a 128-token prefill 3.8 CPU s through oneDNN against 6.2 with the kernels."""
    native = dtype != torch.float32 and not emulated(dtype)
    block = isa()
    if block == "portable":
        return 1 if native else MAX_ROWS
    if native:
        return AVX512_BF16_ROWS if block == "avx512" else MAX_ROWS
    return AVX2_MAX_ROWS


def _rows_fit(x: torch.Tensor, rows: int | None = None) -> bool:
    """x: a few fp32 or bf16 rows on the CPU (`max_rows`), no autograd, and the kernels built. Asked
    before every projection of a decode step, first thing after the experts have streamed their
    weights through the caches: few calls (each costs cache misses there). `rows`: the rows of x the
    kernel reads (default all)."""
    dtype = x.dtype
    return (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and x.dim() == 2
        and 0 < (x.shape[0] if rows is None else rows) <= max_rows(dtype)
        and x.is_cpu
        and not (x.requires_grad and torch.is_grad_enabled())
        and library() is not None
    )


def _weight_fits(weight: torch.Tensor, dtype: torch.dtype, columns: int) -> bool:
    """A row-major weight [out, columns] of `dtype`, no autograd."""
    return (
        weight.dtype is dtype
        and weight.dim() == 2
        and weight.shape[1] == columns
        and weight.is_contiguous()
        and not (weight.requires_grad and torch.is_grad_enabled())
    )


def _bias_fits(bias: torch.Tensor | None, size: int) -> bool:
    return bias is None or (bias.is_cpu and bias.shape == (size,))


def fits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int | None = None
) -> bool:
    """Whether `linear_rows` takes x [n, in] against weight [out, in] and bias [out] (else torch,
    which also names any mismatch); `rows` as for `_rows_fit`."""
    return (
        _rows_fit(x, rows) and _weight_fits(weight, x.dtype, x.shape[1]) and _bias_fits(bias, weight.shape[0])
    )


def _ffn_fits(ffn: FFN, dtype: torch.dtype, hidden: int) -> bool:
    """Whether the kernels take rows of `dtype` [n, hidden] through ffn = (gate_up [2I, hidden], down
    [hidden, I], gate_up_bias [2I] | None, down_bias [hidden] | None): the weights' side of `fits_ffn`."""
    gate_up, down, gate_up_bias, down_bias = ffn
    rows = gate_up.shape[0]
    if not _weight_fits(gate_up, dtype, hidden) or rows % 2 or not _bias_fits(gate_up_bias, rows):
        return False
    return _weight_fits(down, dtype, rows // 2) and down.shape[0] == hidden and _bias_fits(down_bias, hidden)


def fits_ffn(x: torch.Tensor, ffn: FFN, rows: int | None = None) -> bool:
    """Whether `swiglu_group` takes x [n, hidden] through ffn = (gate_up [2I, hidden], down
    [hidden, I], gate_up_bias [2I] | None, down_bias [hidden] | None); `rows` as for `_rows_fit`."""
    return _rows_fit(x, rows) and _ffn_fits(ffn, x.dtype, x.shape[1])


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's address as the kernels take it (None: NULL)."""
    return None if t is None else t.data_ptr()


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (the kernels read rows, in x's own dtype)."""
    return x if x.stride(1) == 1 else x.contiguous()


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block: str | None = None
) -> torch.Tensor:
    """x: [n, in], weight: [out, in], bias: [out] -> [n, out] in x's dtype (where `fits`); `block`:
    one of ISAS the CPU runs (default `isa()`)."""
    lib = library()
    assert lib is not None
    rows = unit_rows(x)
    n, k = rows.shape
    o = weight.shape[0]
    out = torch.empty(n, o, dtype=x.dtype)  # [n, out]: the kernel writes x's dtype
    b = wide_bias(bias)
    bf16 = int(weight.dtype == torch.bfloat16)
    w, code, threads = weight.data_ptr(), ISAS[block or isa()], torch.get_num_threads()
    status = lib.flowmoe_linear(
        rows.data_ptr(), rows.stride(0), n, k, w, bf16, o, address(b), out.data_ptr(), o, code, threads
    )
    check(status, "linear_rows")
    return out


def check(status: int, name: str) -> None:
    """A kernel's status: 1 where it found no memory for its buffers."""
    if status != 0:
        raise MemoryError(f"{name}: no memory for the kernel's buffers")


def swiglu_group(
    xs: list[torch.Tensor], ffns: list[FFN], moe: MoESpec, block: str | None = None
) -> list[torch.Tensor]:
    """Expert FFNs in one call: xs[e] [n_e, hidden] through ffns[e] -> [n_e, hidden] each, in the
    experts' dtype (views of one output buffer). Every (x, ffn) must `fits_ffn`, and all experts
    share one shape and dtype; `block` as for `linear_rows`."""
    lib = library()
    assert lib is not None
    hidden, inter = ffns[0][1].shape
    rows = [x.contiguous() for x in xs]  # each [n_e, hidden], in the experts' dtype
    counts = [r.shape[0] for r in rows]
    outs = torch.empty(sum(counts), hidden, dtype=xs[0].dtype)  # [sum n_e, hidden]: the kernel writes it
    status = lib.flowmoe_ffn_group(
        len(rows), native.pointers([r.data_ptr() for r in rows]), (ctypes.c_int * len(rows))(*counts), hidden,
        inter, *_weights(ffns, biases := _biases(ffns)), *_activation(moe), outs.data_ptr(),
        ISAS[block or isa()], torch.get_num_threads(),
    )  # fmt: skip
    del biases  # alive through the call
    check(status, "swiglu_group")
    return list(outs.split(counts))


def fits_routed(x: torch.Tensor, counts: list[int], ffns: list[FFN]) -> bool:
    """Whether `swiglu_routed` takes counts[e] rows of x [T, hidden] through each of `ffns`: every
    (rows, ffn) one `fits_ffn` takes, all of one shape, and x's rows contiguous."""
    if not _rows_fit(x, max(counts)) or x.stride(1) != 1:
        return False
    dtype, hidden, shape = x.dtype, x.shape[1], ffns[0][0].shape
    return all(f[0].shape == shape and _ffn_fits(f, dtype, hidden) for f in ffns)


def swiglu_routed(
    x: torch.Tensor,
    rows: torch.Tensor,
    scales: torch.Tensor,
    counts: list[int],
    ffns: list[FFN],
    moe: MoESpec,
    block: str | None = None,
) -> torch.Tensor:
    """A layer's routed experts in one call from the rows of x [T, hidden] they take: expert e's
    counts[e] rows are x[rows[...]] (rows [sum n_e] int64, each expert's in turn), each output row
    times its scale (scales [sum n_e], fp32 or x's dtype) -> [sum n_e, hidden] in the product's dtype
    (torch's: the experts' output, rounded to their dtype, times the scales). Every expert must take
    at most `max_rows` rows and `fits_routed` hold; `block` as for `linear_rows`."""
    lib = library()
    assert lib is not None
    hidden, inter = ffns[0][1].shape
    index, weight = rows.contiguous(), scales.contiguous()  # [sum n_e] each
    dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(index.shape[0], hidden, dtype=dtype)  # [sum n_e, hidden]: the kernel writes it
    status = lib.flowmoe_ffn_routed(
        len(counts), x.data_ptr(), x.stride(0), index.data_ptr(), (ctypes.c_int * len(counts))(*counts),
        hidden, inter, *_weights(ffns, biases := _biases(ffns)), *_activation(moe), weight.data_ptr(),
        int(weight.dtype == torch.bfloat16), out.data_ptr(), int(dtype == torch.bfloat16),
        ISAS[block or isa()], torch.get_num_threads(),
    )  # fmt: skip
    del biases  # alive through the call
    check(status, "swiglu_routed")
    return out


def _biases(ffns: list[FFN]) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None:
    """The experts' gate_up and down biases as the kernels read them (fp32), kept alive by the
    caller through the kernel's call; None where none has any."""
    if all(f[2] is None and f[3] is None for f in ffns):
        return None
    return [wide_bias(f[2]) for f in ffns], [wide_bias(f[3]) for f in ffns]


def _weights(
    ffns: list[FFN], biases: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None
) -> tuple[object, ...]:
    """The kernels' weight arguments: gate_ups, downs, bf16, gate_up_biases, down_biases."""
    gate_ups = native.pointers([f[0].data_ptr() for f in ffns])
    downs = native.pointers([f[1].data_ptr() for f in ffns])
    bf16 = int(ffns[0][0].dtype == torch.bfloat16)
    if biases is None:
        return gate_ups, downs, bf16, nulls(len(ffns)), nulls(len(ffns))
    gate_up_biases, down_biases = (native.pointers([address(b) for b in side]) for side in biases)
    return gate_ups, downs, bf16, gate_up_biases, down_biases


@functools.cache
def nulls(n: int) -> ctypes.Array[ctypes.c_void_p]:
    """n NULL pointers, for the bias arguments of a kernel call none of whose experts has biases
    (made once per n; the kernels only read them)."""
    return native.pointers([None] * n)


def _activation(moe: MoESpec) -> tuple[int, float, float]:
    """The kernels' activation arguments: clamped, alpha, limit."""
    return int(moe.activation == "clamped_swiglu"), moe.swiglu_alpha, moe.swiglu_limit


def wide_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as the kernels read it: contiguous fp32."""
    return None if bias is None else bias.float().contiguous()
