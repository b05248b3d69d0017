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
import threading
import weakref

import torch
from attrs import frozen

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_combine, cpu_packed
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


@frozen
class _Made:
    """What `prepared` made of an expert (None: the kernels do not read it), and what from: the
    expert (weakly), its projections (the gate_up tuple and down, held as the expert holds them), the
    owner and attribute of each tensor the projections hold, and the id of every tensor read (the
    projections', then the expert's biases; id(None) where an attribute is None). `tensors` holds a
    weak reference to each of those tensors whose callback forgets the entry as the tensor dies, so
    while the entry lives every id it holds is its tensor's (no other live object has that id): a
    tensor rebound in place is let go and seen by its id."""

    expert: weakref.ref[QuantizedExpert]
    gate_up: tuple[PackedWeight, ...]
    down: PackedWeight
    owners: tuple[PackedWeight, ...]  # each tensor's owner, in `names`' order
    names: tuple[str, ...]
    ids: tuple[int, ...]
    tensors: tuple[weakref.ref[torch.Tensor], ...]
    made: cpu_packed.Prepared | None

    def current(self, expert: QuantizedExpert) -> bool:
        """Whether `expert` is still what this was made of: the same object, projections and tensors
        (each attribute read once, in C: a map of getattr and id)."""
        if self.expert() is not expert or expert.gate_up is not self.gate_up or expert.down is not self.down:
            return False
        biases = id(expert.gate_up_bias), id(expert.down_bias)
        return self.ids == (*map(id, map(getattr, self.owners, self.names)), *biases)


# id(expert) -> what `prepared` made of it; the entry goes when the expert or a tensor it read is freed
_PREPARED: dict[int, _Made] = {}


def prepared(expert: QuantizedExpert) -> cpu_packed.Prepared | None:
    """`expert` as the kernel call takes it (`kernel_form`, then `cpu_packed.prepare`: its checks and
    pointers, once), or None; kept until the expert is freed or any of its tensors is no longer the
    one it was made from (model/arena.py rebinds them). Asked for every expert of every decode step:
    the check reads each tensor's attribute once, nothing else."""
    key = id(expert)
    held = _PREPARED.get(key)
    if held is not None and held.current(expert):
        return held.made
    form = kernel_form(expert)
    made = None if form is None else cpu_packed.prepare(form[2], form[0], form[1], expert.down.shape[0])
    slots = [(w, name) for w in expert.weights() for name in w.names()]
    owners, names = tuple(w for w, _ in slots), tuple(name for _, name in slots)
    read = [*map(getattr, owners, names), expert.gate_up_bias, expert.down_bias]

    def forget(_: object) -> None:
        _PREPARED.pop(key, None)

    tensors = tuple(weakref.ref(t, forget) for t in read if t is not None)
    made_of = _Made(weakref.ref(expert, forget), expert.gate_up, expert.down, owners, names,
                    tuple(map(id, read)), tensors, made)  # fmt: skip
    _PREPARED[key] = made_of
    return made


def _kernel_experts(ffns: list[FFNWeights]) -> list[cpu_packed.Prepared] | None:
    """The experts of `ffns` as one kernel call takes them (`prepared`): each a PackedFFN the kernels
    read, all of one kind; else None."""
    experts: list[cpu_packed.Prepared] = []
    for f in ffns:
        if not isinstance(f, PackedFFN):
            return None
        e = prepared(f.expert)
        if e is None or (experts and not e.same_kind(experts[0])):
            return None
        experts.append(e)
    return experts or None


# thread -> (rows, hidden, dtype) -> the buffer the kernel writes unscaled outputs into before they are
# scaled (dead once scaled: reused by the thread's next call of that shape)
_UNSCALED = threading.local()
UNSCALED_ROWS = 64  # the most rows kept a buffer (a decode step's; prefill's allocate theirs)


def _unscaled(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
    """This thread's buffer [rows, hidden] of `dtype` for outputs that are scaled next (None: a new one)."""
    if rows > UNSCALED_ROWS:
        return None
    buffers = _UNSCALED.__dict__.setdefault("buffers", {})
    key = (rows, hidden, dtype)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(rows, hidden, dtype=dtype)
    return buffer


def packed_scaled(
    gathered: torch.Tensor, scales: torch.Tensor, counts: list[int], ffns: list[FFNWeights], moe: MoESpec
) -> list[torch.Tensor] | None:
    """`MoEModel.scaled_experts` by the packed kernels: gathered [sum n_e, hidden] (each expert's rows
    in turn), scales [sum n_e, 1] -> each expert's scaled outputs [n_e, hidden]; None where they do
    not take them all (the module docstring)."""
    if not ffns or 0 in counts:
        return None
    experts = _kernel_experts(ffns)
    if experts is None:
        return None
    dtype = ffns[0].expert.dtype  # type: ignore[attr-defined]  # a PackedFFN's, checked
    if gathered.dtype != dtype or not cpu_packed.takes(gathered, experts[0].hidden):
        return None
    return _run(gathered, scales, counts, experts, moe)


def _run(
    gathered: torch.Tensor,
    scales: torch.Tensor,
    counts: list[int],
    experts: list[cpu_packed.Prepared],
    moe: MoESpec,
) -> list[torch.Tensor]:
    """`packed_scaled` once taken: gathered [sum n_e, hidden] (cpu_packed.takes), scales [sum n_e, 1]
    -> each expert's scaled outputs [n_e, hidden], an expert of more than MAX_ROWS rows in pieces."""
    step = cpu_packed.MAX_ROWS
    pieces = [min(step, n - at) for n in counts for at in range(0, n, step)]  # rows per kernel call
    kernel_experts = [e for e, n in zip(experts, counts, strict=True) for _ in range(0, n, step)]
    # [sum n_e, hidden]: Llama 4 scales the expert's input, the others its output
    x = (gathered * scales.to(gathered.dtype) if moe.scale_input else gathered).contiguous()
    row_bytes = x.stride(0) * x.element_size()
    starts = [x.data_ptr() + at * row_bytes for at in itertools.accumulate(pieces[:-1], initial=0)]
    if moe.scale_input:
        out = cpu_packed.swiglu_prepared(starts, pieces, kernel_experts, x.dtype, moe)  # [sum n_e, hidden]
        return list(out.split_with_sizes(counts))
    product, outs = _products(x.shape[0], x.shape[1], x.dtype, scales, counts)
    _scaled(starts, pieces, kernel_experts, x.dtype, moe, scales, product)
    return outs


def _products(
    rows: int, hidden: int, dtype: torch.dtype, scales: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The buffer [rows, hidden] the scaled outputs go to (the product's dtype: fp32 scales, fp32) and
    each expert's view of it, made before the kernel call (after it, the caches hold its weights)."""
    product = torch.empty(rows, hidden, dtype=torch.promote_types(dtype, scales.dtype))
    return product, list(product.split_with_sizes(counts))


def _scaled(
    starts: list[int],
    pieces: list[int],
    experts: list[cpu_packed.Prepared],
    dtype: torch.dtype,
    moe: MoESpec,
    scales: torch.Tensor,
    product: torch.Tensor,
) -> None:
    """The kernel's outputs (into this thread's buffer) times scales [sum n_e, 1] into `product`
    [sum n_e, hidden]: torch's `out * scales`, bit for bit, in one C call (cpu_combine.scale_rows)."""
    rows, hidden = product.shape
    out = cpu_packed.swiglu_prepared(
        starts, pieces, experts, dtype, moe, None, _unscaled(rows, hidden, dtype)
    )
    cpu_combine.scale_rows(out, scales, product)


def packed_routed(
    x: torch.Tensor, routing: Routing, ffns: dict[int, FFNWeights], moe: MoESpec
) -> dict[int, torch.Tensor] | None:
    """`MoEModel.routed_experts` by the packed kernels: x [T, hidden] -> expert -> its scaled outputs
    [n_e, hidden]; None where they do not take them all (checked before the rows are gathered). A
    single token's experts all read its row where it lies (no gather)."""
    if not x.is_cpu or not ffns or not isinstance(next(iter(ffns.values())), PackedFFN):  # kept unpacked
        return None
    experts = sorted(ffns)  # ascending: a view of the routing's sorted rows
    kernel_experts = _kernel_experts([ffns[e] for e in experts])  # None: some expert kept unpacked
    if kernel_experts is None or x.dtype != ffns[experts[0]].expert.dtype:  # type: ignore[attr-defined]
        return None
    hidden = kernel_experts[0].hidden
    if not cpu_packed.takes(x, hidden):
        return None
    counts = [routing.sizes[e] for e in experts]  # not routing.tokens: no split of its rows
    if 0 in counts:
        return None
    rows, scales = routing.rows_of(experts)  # [sum n_e] each
    if not rows.is_cpu:
        rows, scales = rows.cpu(), scales.cpu()
    column = scales.unsqueeze(1)  # [sum n_e, 1]
    if x.shape[0] > 1 or moe.scale_input or x.stride(1) != 1:
        return dict(
            zip(experts, _run(x.index_select(0, rows), column, counts, kernel_experts, moe), strict=True)
        )
    # one token: each expert's one row is x's [1, hidden]
    product, outs = _products(len(experts), hidden, x.dtype, column, counts)
    scaled = dict(zip(experts, outs, strict=True))
    _scaled([x.data_ptr()] * len(experts), counts, kernel_experts, x.dtype, moe, column, product)
    return scaled
