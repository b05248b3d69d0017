"""Routed experts kept packed (int8, int4, hqq4), computed on the CPU from their packed bytes: the
dispatch from `MoEModel.routed_experts` / `scaled_experts` to kernels/cpu_packed.py.

A group of experts goes to the packed kernels in one call where every one of them is a `PackedFFN`
(`LayerWeights.expert` under a packed expert format) whose projections are all `Int8Weight`s or all
`Int4Weight`s of one group size the kernels take, on the CPU, in the model's dtype (fp32 or bf16);
otherwise None, and the caller dequantizes them in torch (a PackedFFN's tensors, read). An expert with
more than cpu_packed.MAX_ROWS rows (prefill) goes in pieces of at most that many, each reading the
packed weights again: a row's result does not depend on the rows beside it (tests/test_cpu_packed.py),
and re-reading the packed bytes costs far less than dequantizing the expert in torch per call. The
result is the callers': each expert's outputs times the rows' combine weights (or its input scaled
first, Llama 4's `scale_input`).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_packed
from flowmoe.kernels.no_copy import on
from flowmoe.kernels.router import Routing
from flowmoe.model.quantized import Int4Weight, Int8Weight, PackedFFN, PackedWeight, QuantizedExpert
from flowmoe.model.weights import FFNWeights


def _projection(w: PackedWeight, rows: slice) -> cpu_packed.Projection:
    """Rows `rows` of a packed projection as the kernels read it: (q, scale, zero), views."""
    if isinstance(w, Int8Weight):
        return w.values[rows], w.scale[rows], None
    assert isinstance(w, Int4Weight)
    return w.packed[rows], w.scale[rows], w.zero[rows]


def kernel_form(expert: QuantizedExpert) -> tuple[str, int, cpu_packed.PackedFFN] | None:
    """(format, group, the expert as cpu_packed reads it) where every projection is an Int8Weight
    ("int8", group 0) or an Int4Weight of one group ("int4"), gate and up as one [2I, hidden] block
    or two [I, hidden] ones; None otherwise (fp8, the checkpoint layouts)."""
    weights = expert.weights()
    if all(isinstance(w, Int8Weight) for w in weights):
        fmt, group = "int8", 0
    elif all(isinstance(w, Int4Weight) for w in weights):
        fmt, group = "int4", weights[0].group  # type: ignore[attr-defined]  # an Int4Weight, checked
        if any(w.group != group for w in weights):  # type: ignore[attr-defined]
            return None
    else:
        return None
    if len(expert.gate_up) == 1:  # [2I, hidden], gate rows first
        both, inter = expert.gate_up[0], expert.down.shape[1]
        gate, up = _projection(both, slice(0, inter)), _projection(both, slice(inter, 2 * inter))
    elif len(expert.gate_up) == 2:
        gate, up = (_projection(w, slice(None)) for w in expert.gate_up)
    else:
        return None
    down = _projection(expert.down, slice(None))
    return fmt, group, (gate, up, down, expert.gate_up_bias, expert.down_bias)


_Refs = tuple["weakref.ref[QuantizedExpert]", tuple["weakref.ref[torch.Tensor]", ...]]
# id(expert) -> (the expert and its tensors, as weak references), what `prepared` made of them
_PREPARED: dict[int, tuple[_Refs, cpu_packed.Prepared | None]] = {}


def prepared(expert: QuantizedExpert) -> cpu_packed.Prepared | None:
    """`expert` as the kernel call takes it (`kernel_form`, then `cpu_packed.prepare`: its checks and
    pointers, once), or None; kept until the expert is freed or any of its tensors is no longer the
    one it was made from (model/arena.py rebinds them)."""
    tensors = expert.tensors()
    key = id(expert)
    held = _PREPARED.get(key)
    if (
        held is not None
        and held[0][0]() is expert
        and len(held[0][1]) == len(tensors)
        and all(ref() is t for ref, t in zip(held[0][1], tensors, strict=True))
    ):
        return held[1]
    form = kernel_form(expert)
    made = None if form is None else cpu_packed.prepare(form[2], form[0], form[1], expert.down.shape[0])
    forget = weakref.ref(expert, lambda _, key=key: _PREPARED.pop(key, None))  # type: ignore[misc]
    _PREPARED[key] = ((forget, tuple(weakref.ref(t) for t in tensors)), made)
    return made


def packed_scaled(
    gathered: torch.Tensor, scales: torch.Tensor, counts: list[int], ffns: list[FFNWeights], moe: MoESpec
) -> list[torch.Tensor] | None:
    """`MoEModel.scaled_experts` by the packed kernels: gathered [sum n_e, hidden] (each expert's rows
    in turn), scales [sum n_e, 1] -> each expert's scaled outputs [n_e, hidden]; None where they do
    not take them all (the module docstring)."""
    if not ffns or 0 in counts or not all(isinstance(f, PackedFFN) for f in ffns):
        return None
    experts = [e for e in (prepared(f.expert) for f in ffns) if e is not None]  # type: ignore[attr-defined]
    if len(experts) < len(ffns):
        return None
    first = experts[0]
    shape = (first.fmt, first.group, first.hidden, first.inter)
    if any((e.fmt, e.group, e.hidden, e.inter) != shape for e in experts):
        return None
    dtype = ffns[0].expert.dtype  # type: ignore[attr-defined]  # a PackedFFN's, checked
    if gathered.dtype != dtype or not cpu_packed.takes(gathered, first.hidden):
        return None
    step = cpu_packed.MAX_ROWS
    pieces = [min(step, n - at) for n in counts for at in range(0, n, step)]  # rows per kernel call
    kernel_experts = [e for e, n in zip(experts, counts, strict=True) for _ in range(0, n, step)]
    # [sum n_e, hidden]: Llama 4 scales the expert's input, the others its output
    x = (gathered * scales.to(dtype) if moe.scale_input else gathered).contiguous()
    row_bytes = x.stride(0) * x.element_size()
    starts = [x.data_ptr() + at * row_bytes for at in itertools.accumulate(pieces[:-1], initial=0)]
    out = cpu_packed.swiglu_prepared(starts, pieces, kernel_experts, x.dtype, moe)  # [sum n_e, hidden]
    return list((out if moe.scale_input else out * scales).split(counts))  # fp32 scales: an fp32 product


def packed_routed(
    x: torch.Tensor, routing: Routing, ffns: dict[int, FFNWeights], moe: MoESpec
) -> dict[int, torch.Tensor] | None:
    """`MoEModel.routed_experts` by the packed kernels: x [T, hidden] -> expert -> its scaled outputs
    [n_e, hidden]; None where they do not take them all (checked before the rows are gathered)."""
    if not all(isinstance(f, PackedFFN) for f in ffns.values()):
        return None
    experts = sorted(ffns)  # ascending: a view of the routing's sorted rows
    counts = [routing.sizes[e] for e in experts]  # not routing.tokens: no split of its rows
    if x.device.type != "cpu":
        return None
    rows, scales = (on(t, x.device) for t in routing.rows_of(experts))  # [sum n_e] each
    outs = packed_scaled(x[rows], scales[:, None], counts, [ffns[e] for e in experts], moe)
    return None if outs is None else dict(zip(experts, outs, strict=True))
