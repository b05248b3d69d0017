"""A layer's routed experts in one grouped GEMM per projection (issue 29 item 3): the gathered rows
of every expert of the group through gate_up in one `torch._grouped_mm`, the SwiGLU once over all
rows, down in one more: a constant number of torch operations whatever the number of experts,
where the per-expert path dispatches ~5 per expert plus the split and cat around them.

Why views of the weights as they lie, not a stack: a grouped GEMM wants the experts' weights as one
3D tensor [S, out, in]. Stacking a group's weights each call would read and write every expert's
bytes once more (HBM bandwidth, the very cost the GEMM is bound by at decode), and a Triton kernel
over a table of weight pointers would make triton a dependency of the hot path and run on the CPU
only in its (slow) interpreter. Instead the group's weights are viewed in place (`stacked`): tensors
of one shape and dtype that lie in one buffer at a common stride (a layer's experts in its host
arena, flowmoe/model/arena.py, are: one expert's tensors after the other, each aligned) are one
strided view [S, out, in] of every slot at that stride the buffer holds, made once per layer and
kept on its buffer, and the slots the group leaves out get no rows (the GEMM reads nothing of
them). Weights that do not lie so take the per-expert path.

On the GPU: the device's copies of a runtime's experts lie in one pool of equal slots
(runtime/expert_slots.py; resident and staged experts alike, one slot per expert, its pages landing
there), so the experts of a group present on the device are one view of the pool as the host's are
of its arena. The pool is made where the accounting allows it exactly (every dense part resident, so
the scheduler's copy buffer holds whole experts: slots = resident experts + buffer // expert bytes;
the ledger's bytes unchanged), else each expert keeps its own buffer. A slot freed by EVICT is
reused only after the evicting lane's stream passes an event recorded there (what `record_stream`
gave the caching allocator). The first GPU node of a group takes the experts in the pool whose
copies its stream can wait for on the device (runtime/lane_weights.py `taken`: producers launched,
`wait_event`, no host sync); the others run at their own nodes. On CUDA the pool is opt-in
(FLOWMOE_EXPERT_SLOTS=1) until a GPU run has checked it; without CUDA it is on where weights are
copies (tests/test_expert_slots.py runs every scheduler with the "GPU" at cpu:0).

The forms per device:
* CPU: W @ x.T per expert, (2I x H) @ (H x n_e), with the rows as columns: the form
  kernels/linear.py measured faster than x @ W.T for few rows. The CPU's grouped GEMM runs one mm
  per group, on operands laid out as the per-expert path's, so the GEMMs give its floats bit for
  bit; the SwiGLU, one call over every expert's rows, may differ by an ulp in a few elements
  (torch's vectorized silu computes a tensor's last elements with its scalar code, so which
  elements those are depends on the tensor's length): equal within 1e-5 relative, not bit for
  bit. Taken where linear.py would take that form for each expert: fp32 or bf16, each expert's
  rows in its `rows_as_columns`, no emulated half precision from WIDEN_ROWS rows on.
* CUDA: x @ W.T for the group, bf16 on sm90 / sm100 only, where torch runs it as one CUTLASS
  kernel; elsewhere torch's CUDA grouped GEMM loops over the groups after reading `offs` back to
  the host (a sync per call), so other cards and dtypes keep the per-expert path.

Not taken (the per-expert path instead): one expert, biases, GPT-OSS's clamped SwiGLU, rows or
widths whose strides are not a multiple of 16 bytes (the grouped GEMM's requirement), a group whose
weights are not in ascending slots (MoEModel.routed_experts orders a group by where it lies), and
FLOWMOE_GROUPED_EXPERTS=0.
"""

from __future__ import annotations

import math
import os
from array import array
from itertools import accumulate, pairwise

import torch
import torch.nn.functional as F

from flowmoe.core.spec import MoESpec
from flowmoe.kernels.cpu_expert import FFN
from flowmoe.kernels.linear import WIDEN_ROWS, _emulated, rows_as_columns

ALIGN = 16  # bytes: the grouped GEMM's stride and address alignment
MAX_SLOTS = 1024  # a view of more slots than this is not taken (a layer's buffer holds fewer)


def switched_on() -> bool:
    """Whether the grouped path may be taken (FLOWMOE_GROUPED_EXPERTS=0: never; nor do the GPU lanes
    then group experts, runtime/lane_weights.py)."""
    return os.environ.get("FLOWMOE_GROUPED_EXPERTS", "1") != "0"


def stacked(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """`tensors` (each [out, in], contiguous, one dtype, in one buffer at a common stride, ascending)
    as one view [S, out, in] of every slot at that stride the buffer holds, and each one's slot;
    None where they do not lie so. The slots the group leaves out (other experts, or the layer's
    other bytes) get no rows, so the GEMM reads nothing there; one view serves every group of a
    layer at that stride (`_view` keeps it)."""
    lay = _lay(tensors)
    if lay is None:
        return None
    _, _, before, after, slots = lay
    return _viewed(tensors[0], lay, before, after), [before + slot for slot in slots]


# where tensors lie in their buffer: (the first one's element, the stride between slots, how many
# slots the buffer holds before it and from it on, each tensor's slot counted from the first's)
Lay = tuple[int, int, int, int, list[int]]


def _lay(tensors: list[torch.Tensor]) -> Lay | None:
    """Where `tensors` lie in their buffer (see `Lay`); None where `stacked` does not take them."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    if any(
        t.shape != first.shape
        or t.dtype != first.dtype
        or t.device != first.device
        or not t.is_contiguous()
        or t.untyped_storage().data_ptr() != storage
        for t in tensors
    ):
        return None
    offsets = [int(t.storage_offset()) for t in tensors]  # elements
    at, size, numel = offsets[0], first.element_size(), first.numel()
    step = math.gcd(*(o - at for o in offsets)) or numel
    before, after = at // step, (first.untyped_storage().nbytes() // size - at - numel) // step + 1
    slots = [(o - at) // step for o in offsets]
    if (
        any(later <= earlier for earlier, later in pairwise(slots))
        or step < numel
        or step * size % ALIGN
        or first.data_ptr() % ALIGN
        or before + after > MAX_SLOTS
    ):
        return None
    return at, step, before, after, slots


def _viewed(first: torch.Tensor, lay: Lay, before: int, after: int) -> torch.Tensor:
    """The view [before + after, out, in] of `lay`'s buffer whose slot `before` is `first`."""
    at, step, *_ = lay
    return _view(first, (before + after, *first.shape), (step, *first.stride()), at - before * step)


def _view(first: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], base: int) -> torch.Tensor:
    """first's storage viewed as `shape` / `stride` from element `base`: made once per layer buffer
    (flowmoe/model/arena.py; kept on it, so it lives as long as the buffer) and reused, not made
    per call (an operation each)."""
    arena = getattr(first, "arena", None)
    if arena is None:
        return first.as_strided(shape, stride, base)
    views = arena.__dict__.setdefault("grouped_views", {})  # the layer's views, by where they lie
    key = (first.dtype, shape, stride, base)
    view = views.get(key)
    if view is None:
        view = views[key] = first.as_strided(shape, stride, base)
    return view


def _takes(x: torch.Tensor, counts: list[int], ffns: list[FFN], moe: MoESpec) -> bool:
    """Whether the grouped path takes x [sum n_e, hidden] through `ffns` (see the module's notes)."""
    gate_up = ffns[0][0]
    widths = (x.shape[-1], gate_up.shape[0] // 2)  # hidden, I
    if (
        len(ffns) < 2
        or not switched_on()
        or moe.activation == "clamped_swiglu"
        or any(f[2] is not None or f[3] is not None for f in ffns)
        or x.dim() != 2
        or not x.is_contiguous()
        or x.dtype != gate_up.dtype
        or any(w * x.element_size() % ALIGN for w in widths)
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
    if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not all(map(rows_as_columns, counts)):
        return False
    return not (_emulated(x.dtype) and max(counts) >= WIDEN_ROWS)


def swiglu_grouped(x: torch.Tensor, counts: list[int], ffns: list[FFN], moe: MoESpec) -> torch.Tensor | None:
    """x [sum n_e, hidden]: the rows of each expert of `ffns` in turn (counts[e] of them), ffns[e] =
    (gate_up [2I, hidden], down [hidden, I], None, None) -> the experts' outputs [sum n_e, hidden] in
    the same order, unscaled; None where the grouped path does not take them."""
    if not _takes(x, counts, ffns, moe):
        return None
    gate_up, down = _lay([f[0] for f in ffns]), _lay([f[1] for f in ffns])
    if gate_up is None or down is None or gate_up[4] != down[4]:
        return None
    before, after = min(gate_up[2], down[2]), min(gate_up[3], down[3])  # the slots both buffers hold
    rows = [0] * (before + after)  # per slot: those the group leaves out get none
    for slot, count in zip(gate_up[4], counts, strict=True):
        rows[before + slot] = count
    if x.is_cuda:  # from page-locked memory: no wait for the stream
        offs = torch.tensor(list(accumulate(rows)), dtype=torch.int32, pin_memory=True)  # [S]
        offs = offs.to(x.device, non_blocking=True)
    else:  # the host's own ints: no operation
        offs = torch.frombuffer(array("i", accumulate(rows)), dtype=torch.int32)  # [S]
    form = _rows_as_columns if x.is_cpu else _rows_as_rows
    first = ffns[0]
    return form(x, _viewed(first[0], gate_up, before, after), _viewed(first[1], down, before, after), offs)


def _rows_as_columns(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """The CPU's form: W @ x.T per slot. x [n, hidden], gate_up [S, 2I, hidden], down [S, hidden, I],
    offs [S] (each slot's last row + 1) -> [n, hidden] (a transposed view)."""
    n, inter = x.shape[0], gate_up.shape[1] // 2
    h = torch._grouped_mm(gate_up, x.t(), offs=offs)  # [2I, n]
    act = x.new_empty_strided((inter, n), (1, inter))  # [I, n], laid out [n, I] as the per-expert path's
    torch.mul(F.silu(h[:inter]), h[inter:], out=act)
    return torch._grouped_mm(down, act, offs=offs).t()  # [n, hidden]


def _rows_as_rows(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """CUDA's form: x @ W.T for the group (one CUTLASS kernel per projection on sm90 / sm100).
    Shapes as `_rows_as_columns`'s -> [n, hidden]."""
    inter = gate_up.shape[1] // 2
    h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)  # [n, 2I]
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [n, I]
    return torch._grouped_mm(act, down.transpose(1, 2), offs=offs)  # [n, hidden]
