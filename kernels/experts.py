"""Expert feed-forward networks: SwiGLU (SiLU) and GPT-OSS's clamped SwiGLU, with optional biases.

Public entry points (stable; bench/cpu_kernels.py measures them):

* `swiglu_ffn(x, gate_up, down, moe, gate_up_bias, down_bias)`: one expert's FFN for its rows.
* `swiglu_ffn_group(xs, ffns, moe)`: the FFNs of several experts (a layer's routed experts) in
  one call, so that a decode step pays one dispatch per layer rather than one per expert.
* `swiglu_ffn_gathered(x, counts, ffns, moe)`: several experts' rows gathered in one tensor, in
  one grouped GEMM per projection (kernels/grouped_experts.py) where the CPU kernels take none of
  them and the grouped path takes them all; None otherwise (then `swiglu_ffn_group`).
* `swiglu_ffn_routed(x, rows, scales, counts, ffns, moe)`: a layer's routed experts straight from
  the rows of x they take, each output row times its combine weight, in one CPU kernel call (the
  gather and the scale inside it); None where the CPU kernels do not take them all.
* `swiglu_ffn_torch(x, (gate_up, down, gate_up_bias, down_bias), moe)`: the same math composed of
  torch ops (the reference, and the path for what the CPU kernels do not take).

fp32 or bf16 rows on the CPU, up to `cpu_expert.max_rows` (32; 128 fp32 rows with the AVX2 or
AVX-512 block, whose tiles reuse each weight across rows), run cpu_expert.c: gate/up projections
fused with the activation, each weight read once per call. Everything else (more rows, fp16, CUDA) is
`swiglu_ffn_torch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert
from flowmoe.kernels.grouped_experts import swiglu_grouped
from flowmoe.kernels.linear import WIDEN_ROWS, _emulated, linear

FFN = cpu_expert.FFN
SLAB_BYTES = 4 << 20  # the fp32 copy of a widened weight's slab (`_widened_in_slabs`)


def swiglu_ffn(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    moe: MoESpec,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [n, hidden], gate_up: [2I, hidden] (gate rows, then up rows), down: [hidden, I] -> [n, hidden]."""
    ffn = (gate_up, down, gate_up_bias, down_bias)
    if cpu_expert.fits_ffn(x, ffn):
        return cpu_expert.swiglu_group([x], [ffn], moe)[0]
    return swiglu_ffn_torch(x, ffn, moe)


def swiglu_ffn_group(xs: list[torch.Tensor], ffns: list[FFN], moe: MoESpec) -> list[torch.Tensor]:
    """xs[e]: [n_e, hidden] with ffns[e] = (gate_up, down, gate_up_bias, down_bias) -> [n_e, hidden]
    each: the experts the CPU kernels take (those of the first one's shape and dtype: all of a
    layer's) in one call, the others one by one."""
    fused = [i for i, (x, ffn) in enumerate(zip(xs, ffns, strict=True)) if cpu_expert.fits_ffn(x, ffn)]
    if fused:
        first = ffns[fused[0]][0]
        fused = [i for i in fused if ffns[i][0].shape == first.shape and ffns[i][0].dtype == first.dtype]
    outs: list[torch.Tensor | None] = [None] * len(xs)
    if fused:
        group = cpu_expert.swiglu_group([xs[i] for i in fused], [ffns[i] for i in fused], moe)
        for i, out in zip(fused, group, strict=True):
            outs[i] = out
    return [
        out if out is not None else swiglu_ffn(x, ffn[0], ffn[1], moe, ffn[2], ffn[3])
        for out, x, ffn in zip(outs, xs, ffns, strict=True)
    ]


def swiglu_ffn_gathered(
    x: torch.Tensor, counts: list[int], ffns: list[FFN], moe: MoESpec
) -> torch.Tensor | None:
    """x [sum n_e, hidden]: each expert's rows in turn (counts[e] of them) -> their outputs [sum n_e,
    hidden] in that order, in one grouped launch per projection; None where the CPU kernels take any
    of them (they come first) or the grouped path does not take them all."""
    c_kernels = x.is_cpu and cpu_expert.library() is not None
    if c_kernels and any(cpu_expert.fits_ffn(rows, f) for rows, f in zip(x.split(counts), ffns, strict=True)):
        return None
    return swiglu_grouped(x, counts, ffns, moe)


def swiglu_ffn_routed(
    x: torch.Tensor,
    rows: torch.Tensor,
    scales: torch.Tensor,
    counts: list[int],
    ffns: list[FFN],
    moe: MoESpec,
) -> torch.Tensor | None:
    """x [T, hidden]; expert e of `ffns` takes counts[e] rows of it, x[rows[...]] (rows [sum n_e], each
    expert's in turn), scales [sum n_e] their combine weights -> the scaled outputs [sum n_e, hidden]
    (the floats of `swiglu_ffn_group` on the gathered rows times the scales), or None where the CPU
    kernels do not take them all."""
    if not x.is_cpu or not cpu_expert.fits_routed(x, counts, ffns):  # is_cpu: no device object made
        return None
    return cpu_expert.swiglu_routed(x, rows, scales, counts, ffns, moe)


def swiglu_ffn_torch(x: torch.Tensor, ffn: FFN, moe: MoESpec) -> torch.Tensor:
    """`swiglu_ffn` composed of torch ops: x [n, hidden], ffn = (gate_up, down, gate_up_bias,
    down_bias) -> [n, hidden]."""
    gate_up, down, gate_up_bias, down_bias = ffn
    h = _widened_in_slabs(x, gate_up, gate_up_bias)  # [n, 2I]
    gate, up = h.chunk(2, dim=-1)  # [n, I] each
    if moe.activation == "clamped_swiglu":
        gate = gate.clamp(max=moe.swiglu_limit)
        up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))
    else:
        act = F.silu(gate) * up
    return _widened_in_slabs(act, down, down_bias)  # [n, hidden]


def _widened_in_slabs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear(x, weight, bias): x [n, in], weight [out, in] -> [n, out] in linear's layout and floats,
    where linear widens a half-precision weight to fp32 (many rows, emulated bf16 / fp16) computed a
    slab of the weight's output rows at a time into one output: each slab's fp32 copy SLAB_BYTES,
    not the whole weight's (a 1024-token prefill's expert: 4 MiB, not 28 + 14 MiB, and its fp32
    product a slab wide). A GEMM's output column reads only its own weight row: the same floats."""
    step = max(1, SLAB_BYTES // (weight.shape[-1] * 4))  # weight rows per slab
    if (
        not x.is_cpu
        or x.dim() != 2
        or weight.shape[0] <= step
        or x.shape[0] < WIDEN_ROWS
        or not _emulated(x.dtype)
        or cpu_expert.fits(x, weight, bias)
    ):
        return linear(x, weight, bias)
    weights = weight.split(step)  # [slab, in] each
    biases = bias.split(step) if bias is not None else [None] * len(weights)
    out = None
    for at, w, b in zip(range(0, weight.shape[0], step), weights, biases, strict=True):
        part = linear(x, w, b)  # [n, slab]
        if out is None:
            out = _laid_out_as(part, weight.shape[0])
        out[:, at : at + w.shape[0]] = part
    assert out is not None
    return out


def _laid_out_as(part: torch.Tensor, columns: int) -> torch.Tensor:
    """An empty [n, columns] laid out as part [n, slab]: row-major, or a transposed view (linear's
    form for few rows)."""
    n = part.shape[0]
    return part.new_empty(columns, n).t() if part.stride(1) != 1 else part.new_empty(n, columns)
