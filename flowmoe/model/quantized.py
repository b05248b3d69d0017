"""Routed experts kept quantized in host memory: what crosses the link under a packed expert format
(Policy.expert_format other than "native"), dequantized into the model's dtype where it lands.

A `QuantizedExpert` holds its projections as `PackedWeight`s, each a few tensors (packed values,
scales, zeros) and a rule to dequantize them, plus its biases, if any, in the model's dtype. Under a
packed format a layer keeps only these in host memory (`LayerWeights.packed`). On the GPU an expert
crosses packed and is dequantized at its first use, on the stream that uses it
(flowmoe/runtime/device_weights.py); an int4 / hqq4 projection there by one Triton kernel launch
into the expert's buffer (kernels/int4_triton.py: the same bits), where triton imports. On the
CPU (`LayerWeights.expert` hands it out as a `PackedFFN`) int8 and int4 / hqq4 experts of up to 32
rows are computed by C kernels that read the packed bytes as they are (kernels/cpu_packed.py,
dispatched by model/packed_experts.py); anything else (more rows, fp8, the GPTQ / AWQ / compressed-tensors
layouts where they did not convert exactly to `Int4Weight` on load, fp16, no compiler) dequantizes
the expert in torch for the call, when its tensors are first read.

The formats (`quantize.py` makes the quantize-on-load ones):

* `fp8`: an FP8 checkpoint's e4m3 values and block scales as stored (model/fp8.py, `FP8Weight`).
* `int8`: per output channel (row), symmetric: `Int8Weight`, a byte per weight and a float32
  scale per row.
* `int4`, `hqq4`: group-wise along the input (columns), asymmetric: `Int4Weight`, two 4-bit values
  per byte and a float16 scale and zero per group of a row; `int4` rounds to nearest at group 128,
  `hqq4` chooses the zeros by HQQ's half-quadratic solver at group 64.
* `int4` (or `int8`) on a GPTQ, AWQ or compressed-tensors checkpoint: its integer weights as
  stored (model/int4_weights.py), or as an `Int4Weight` where that holds them exactly (`as_int4`).
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import ClassVar, Self, TypeVar

import torch
from attrs import define, evolve

from flowmoe.core.expert_formats import DEQUANT_ELEMENTS
from flowmoe.kernels import cpu_packed
from flowmoe.model.weights import FFNWeights


@define
class PackedWeight(ABC):
    """One projection [R, C] (nn.Linear's [out, in]) as its format stores it: the tensors named in
    `TENSORS`, in that order, and how they dequantize."""

    TENSORS: ClassVar[tuple[str, ...]]

    def names(self) -> tuple[str, ...]:
        """The tensors this weight holds: `TENSORS`, less any a format leaves out (None)."""
        return self.TENSORS

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names()]

    def rebuilt(self, given: Iterator[torch.Tensor]) -> Self:
        """This weight with the next tensors of `given` in place of its own (`tensors()` order)."""
        return evolve(self, **{name: next(given) for name in self.names()})

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]:
        """[R, C]: the projection's rows and columns."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[R, C] in `dtype`, on the device the tensors are on, computed in float32."""

    def dequantize_into(self, out: torch.Tensor) -> None:
        """`out` [R, C] (a row block of a larger buffer too) overwritten with `dequantize(out.dtype)`."""
        out.copy_(self.dequantize(out.dtype))


Packed = TypeVar("Packed", bound=PackedWeight)


@define
class Int8Weight(PackedWeight):
    TENSORS = ("values", "scale")

    values: torch.Tensor  # [R, C] int8 in [-127, 127]
    scale: torch.Tensor  # [R, 1] float32: the row's max |w| / 127

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return _filled(self, dtype)

    def dequantize_into(self, out: torch.Tensor) -> None:
        in_row_blocks(out, lambda r: self.values[r].float() * self.scale[r])


@define
class Int4Weight(PackedWeight):
    TENSORS = ("packed", "scale", "zero")

    packed: torch.Tensor  # [R, ceil(C / 2)] uint8: column 2j in the low nibble, 2j + 1 in the high
    scale: torch.Tensor  # [R, ceil(C / group)] float16
    zero: torch.Tensor  # [R, ceil(C / group)] float16: w = (q - zero) x scale
    group: int  # columns one scale and zero cover (the last group partial)
    columns: int  # C (an odd C leaves the last high nibble unused)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.columns

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return _filled(self, dtype)

    def dequantize_into(self, out: torch.Tensor) -> None:
        """On a CUDA device where triton imports (or on any under TRITON_INTERPRET=1: Triton's
        interpreter, as the tests run it on the CPU): one kernel launch, no float32 temporaries; else
        torch operations a few rows at a time. The same bits."""
        kernel = _int4_triton() if out.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else None
        if kernel is not None:
            kernel.dequantize(self.packed, self.scale, self.zero, self.group, out)
        else:
            in_row_blocks(out, self._rows)

    def _rows(self, rows: slice) -> torch.Tensor:  # -> [r, C] float32
        packed = self.packed[rows]  # [r, ceil(C / 2)]
        if self.columns % self.group:  # a partial last group: scale and zero spread over the columns
            q = unpack_int4(packed, self.columns).float()  # [r, C]
            scale = self.scale[rows].float().repeat_interleave(self.group, dim=-1)[:, : self.columns]
            zero = self.zero[rows].float().repeat_interleave(self.group, dim=-1)[:, : self.columns]
            return (q - zero) * scale  # [r, C]
        # whole groups (an even C): the nibbles land in one float32 buffer and the group's zero and scale
        # apply to it in place, broadcast: the same operations on the same values, a third of the passes
        q = torch.empty(packed.shape[0], self.columns // 2, 2, device=packed.device)  # [r, C / 2, 2]
        q[..., 0] = packed & 0x0F
        q[..., 1] = packed >> 4
        groups = q.view(packed.shape[0], -1, self.group)  # [r, G, group]
        groups.sub_(self.zero[rows].float().unsqueeze(-1)).mul_(self.scale[rows].float().unsqueeze(-1))
        return q.view(packed.shape[0], self.columns)


def _filled(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A new [R, C] buffer in `dtype`, on the weight's device, filled by `weight.dequantize_into`."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.tensors()[0].device)
    weight.dequantize_into(out)
    return out


@functools.cache
def _int4_triton() -> ModuleType | None:
    """kernels/int4_triton.py where triton imports, else None (imported at the first use: ~1 s)."""
    try:
        from flowmoe.kernels import int4_triton
    except ImportError:
        return None
    return int4_triton


def in_row_blocks(out: torch.Tensor, block: Callable[[slice], torch.Tensor]) -> None:
    """`out` [R, C] from `block(rows)` ([r, C] float32) a few rows at a time: its float32 temporaries
    (a few [r, C] each) stay within DEQUANT_ELEMENTS values, where a whole projection's would take ~5
    float32 copies of it (2.2 GiB for a Mixtral expert's gate_up on a GPU whose budget counts only the
    expert's own bytes: core/memory.py). Each value rounds as `.to` does."""
    rows, cols = out.shape
    step = max(1, DEQUANT_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        out[start : start + step] = block(slice(start, start + step))


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [n, C] through `weight` [R, C] (+ bias [R]) -> [n, R] by the CPU's packed kernel, which reads
    an `Int8Weight` or `Int4Weight` as it is packed (kernels/cpu_packed.py, `linear`: x quantized to
    int8 per block of 32, as the packed experts' is); None where the kernel does not take them."""
    projection: cpu_packed.Projection  # (q, scale, zero)
    # `type(...) is`, not isinstance: ABCMeta's __instancecheck__ runs in Python (no format has subclasses)
    if type(weight) is Int8Weight:
        fmt, group, projection = "int8", 0, (weight.values, weight.scale, None)
    elif type(weight) is Int4Weight:
        fmt, group, projection = "int4", weight.group, (weight.packed, weight.scale, weight.zero)
    else:
        return None
    if not cpu_packed.linear_fits(x, projection, fmt, group, projection[0].shape[0]):  # the weight's rows
        return None
    return cpu_packed.linear(x, projection, fmt, group, bias)


def stacked_rows(blocks: Sequence[Packed]) -> Packed:
    """Consecutive row blocks of one projection as one weight of their format (int8, int4: each of its
    tensors is [rows, ...]), each tensor joined along the rows."""
    first = blocks[0]
    return evolve(first, **{name: torch.cat([getattr(b, name) for b in blocks]) for name in first.names()})


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] integers in [0, 15] -> uint8 [R, ceil(C / 2)], two per byte (column 2j low)."""
    rows, cols = q.shape
    padded = torch.zeros(rows, cols + cols % 2, dtype=torch.uint8, device=q.device)  # [R, 2 ceil(C/2)]
    padded[:, :cols] = q.to(torch.uint8)
    return padded[:, 0::2] | (padded[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """uint8 [R, ceil(C / 2)] -> uint8 [R, C] in [0, 15]."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [R, ceil(C / 2), 2]
    return pairs.reshape(packed.shape[0], -1)[:, :columns]


@define
class QuantizedExpert:
    """A routed expert kept packed: gate and up (stacked into gate_up where it is used) and down,
    each one or more `PackedWeight`s by rows, the biases unquantized; `dtype` is the model's, the
    one it dequantizes to."""

    gate_up: tuple[PackedWeight, ...]  # row blocks of [2I, hidden], gate rows first
    down: PackedWeight  # [hidden, I]
    dtype: torch.dtype
    gate_up_bias: torch.Tensor | None = None  # [2I] in `dtype`
    down_bias: torch.Tensor | None = None  # [hidden] in `dtype`

    def weights(self) -> tuple[PackedWeight, ...]:
        return (*self.gate_up, self.down)

    def slots(self) -> list[tuple[object, str]]:
        """(owner, attribute) of each tensor, in `tensors()` order (model/arena.py packs them so)."""
        own = [(self, name) for name in ("gate_up_bias", "down_bias") if getattr(self, name) is not None]
        return [*((w, name) for w in self.weights() for name in w.names()), *own]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(owner, name) for owner, name in self.slots()]

    @property
    def nbytes(self) -> int:
        """Bytes held packed: what crosses the link."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def ffn_nbytes(self) -> int:
        """Bytes of the expert dequantized (as the GPU holds it)."""
        weights = sum(rows * cols for rows, cols in (w.shape for w in self.weights()))
        biases = sum(t.numel() for t in (self.gate_up_bias, self.down_bias) if t is not None)
        return (weights + biases) * self.dtype.itemsize

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedExpert:
        """The same expert with `fn` applied to each of its tensors."""
        return self.rebuilt(iter([fn(t) for t in self.tensors()]))

    def rebuilt(self, given: Iterator[torch.Tensor]) -> QuantizedExpert:
        """This expert with the tensors of `given` in place of its own (`tensors()` order)."""
        gate_up = tuple(w.rebuilt(given) for w in self.gate_up)
        down = self.down.rebuilt(given)
        biases = [None if t is None else next(given) for t in (self.gate_up_bias, self.down_bias)]
        return QuantizedExpert(gate_up, down, self.dtype, *biases)

    def to(self, device: torch.device) -> QuantizedExpert:
        """On `device` (the same tensors where they already are), copied asynchronously."""
        return self.mapped(lambda t: t.to(device, non_blocking=True))

    def as_ffn(self) -> PackedFFN:
        """This expert where an FFNWeights is expected, dequantized only where its tensors are read."""
        return PackedFFN(self)

    def to_ffn(self) -> FFNWeights:
        """The expert in flowmoe's layout, in the model's dtype, on the device its tensors are on:
        gate_up [2I, hidden] (gate rows first), down [hidden, I], each row block dequantized into its
        rows of the one buffer."""
        device = self.down.tensors()[0].device
        rows = [w.shape[0] for w in self.gate_up]
        gate_up = torch.empty(sum(rows), self.gate_up[0].shape[1], dtype=self.dtype, device=device)
        for weight, part in zip(self.gate_up, gate_up.split(rows), strict=True):  # [rows, hidden] views
            weight.dequantize_into(part)
        return FFNWeights(gate_up, self.down.dequantize(self.dtype), self.gate_up_bias, self.down_bias)


FFN_FIELDS = ("gate_up", "down", "gate_up_bias", "down_bias")  # FFNWeights's


class PackedFFN(FFNWeights):
    """A packed routed expert handed out where an `FFNWeights` is expected (`LayerWeights.expert`):
    the CPU's packed kernels read `expert` as it is (model/packed_experts.py); any other reader of its
    tensors (gate_up, down, the biases) gets them dequantized into the model's dtype, in torch, once
    per object, on first access."""

    __slots__ = ("expert",)

    def __init__(self, expert: QuantizedExpert) -> None:  # the FFNWeights fields stay unset until read
        self.expert = expert

    def __getattr__(self, name: str) -> torch.Tensor | None:
        """Called for an FFNWeights field not yet set: dequantize them all, then read it."""
        if name not in FFN_FIELDS:
            raise AttributeError(name)
        ffn = self.expert.to_ffn()
        for field in FFN_FIELDS:
            setattr(self, field, getattr(ffn, field))
        return getattr(self, name)  # one of the four just set
