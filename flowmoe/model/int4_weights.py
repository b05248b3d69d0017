"""Integer weights as GPTQ, AWQ and compressed-tensors checkpoints store them: the `PackedWeight`s a
routed expert keeps under `--expert-format int4` (or int8) on such a checkpoint, and what every
other quantized projection is dequantized from on load (model/int4_checkpoints.py reads them;
docs/quantized-checkpoints.md gives each layout's sources).

Each packs `32 / bits` unsigned levels into an int32, the first level in the lowest bits; each
dequantizes a projection [R, C] (nn.Linear's [out, in]) as (level - zero) x scale, with one zero
and one scale per group of input columns and output row, computed in float32:

* GPTQ: `qweight` [C / f, R] packed along the input; `qzeros` [G, R / f] packed along the output,
  each stored one less than the zero (the "v1" convention AutoGPTQ writes; the sum is taken modulo
  2^bits, as AutoGPTQ's own dequantization does) or as is (GPTQModel's "gptq_v2"); `scales` [G, R];
  `g_idx` [C]: each input column's group (act-order: `desc_act`), else column // group.
* AWQ (GEMM): `qweight` [C, R / 8] packed along the output in the order 0 2 4 6 1 3 5 7 (level i
  of a word is column order[i] of its eight), `qzeros` [G, R / 8] likewise, `scales` [G, R].
* compressed-tensors pack-quantized: `weight_packed` [R, ceil(C / f)] packed along the input,
  levels offset by 2^(bits - 1) (signed values stored unsigned); `weight_scale` [R, G];
  symmetric: zero 2^(bits - 1); asymmetric: `weight_zero_point` [ceil(R / f), G] packed along the
  output, offset alike; `weight_g_idx` [C] where the columns were grouped by activation order.

`as_int4` lays a 4-bit one out as flowmoe's own `Int4Weight` where that holds its values exactly,
for the CPU's packed kernels (docs/quantized-checkpoints.md, "Read by the CPU kernels").
"""

from __future__ import annotations

from typing import ClassVar

import torch
from attrs import define

from flowmoe.kernels.cpu_packed import GROUP_STEP
from flowmoe.model.quantized import Int4Weight, PackedWeight, pack_int4

ONE_GROUP_AS = 128  # columns a group where a stored weight has one group a row (flowmoe's int4 group)
# a stored projection read out: levels [R, C] (int32), zero and scale [R, G], each column's group [C]
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # level i of an AWQ word holds column AWQ_ORDER[i] of its eight
AWQ_COLUMNS = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j of eight is level AWQ_COLUMNS[j]


def unpack_levels(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned levels (int32), `32 / bits` per word, lowest bits first, laid
    out along `dim` (0 or 1 of a 2-D tensor): [N, M] -> [N * f, M] or [N, M * f]."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [f]
    mask = (1 << bits) - 1
    if dim == 0:  # [N, M] -> [N, f, M] -> [N * f, M]
        levels = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask
        return levels.reshape(packed.shape[0] * per_word, packed.shape[1])
    levels = (packed.unsqueeze(-1) >> shifts) & mask  # [N, M, f]
    return levels.reshape(packed.shape[0], packed.shape[1] * per_word)


def contiguous_groups(columns: int, group: int, device: torch.device) -> torch.Tensor:
    """[C] int64: column c's group, c // group."""
    return torch.arange(columns, device=device) // group


def dequantize_groups(
    levels: torch.Tensor,
    zero: torch.Tensor,
    scale: torch.Tensor,
    group_of: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """levels [R, C], zero and scale [R, G], group_of [C] -> [R, C] in `dtype`: (level - zero of its
    group) x scale of its group, in float32."""
    index = group_of.long()
    return ((levels.float() - zero.float()[:, index]) * scale.float()[:, index]).to(dtype)


@define
class GPTQWeight(PackedWeight):
    """A GPTQ projection [R, C] as stored (the module docstring)."""

    TENSORS = ("qweight", "qzeros", "scales", "g_idx")

    qweight: torch.Tensor  # [C / f, R] int32
    qzeros: torch.Tensor  # [G, R / f] int32
    scales: torch.Tensor  # [G, R] float16 (as stored)
    g_idx: torch.Tensor | None  # [C] int32 under act-order; None: column // group
    bits: int
    group: int  # columns per group without act-order (C for group_size -1)
    zero_offset: int  # added to a stored zero: 1 in the v1 convention, 0 in v2

    def names(self) -> tuple[str, ...]:
        return self.TENSORS if self.g_idx is not None else self.TENSORS[:-1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[1], self.qweight.shape[0] * 32 // self.bits

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return dequantize_groups(*self.parts(), dtype)

    def parts(self) -> Parts:
        levels = unpack_levels(self.qweight, self.bits, 0).t()  # [R, C]
        stored = unpack_levels(self.qzeros, self.bits, 1)  # [G, R]
        zero = (stored + self.zero_offset) & ((1 << self.bits) - 1)  # modulo 2^bits, as AutoGPTQ takes it
        cols = self.shape[1]
        groups = self.g_idx if self.g_idx is not None else contiguous_groups(cols, self.group, levels.device)
        return levels, zero.t(), self.scales.t(), groups


@define
class AWQWeight(PackedWeight):
    """An AWQ (GEMM) projection [R, C] as stored (the module docstring); 4 bits."""

    TENSORS = ("qweight", "qzeros", "scales")

    qweight: torch.Tensor  # [C, R / 8] int32
    qzeros: torch.Tensor  # [C / group, R / 8] int32
    scales: torch.Tensor  # [C / group, R] float16 (as stored)
    group: int
    bits: ClassVar[int] = 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[1], self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return dequantize_groups(*self.parts(), dtype)

    def parts(self) -> Parts:
        order = torch.tensor(AWQ_COLUMNS, device=self.qweight.device)  # [8]
        levels = _awq_columns(unpack_levels(self.qweight, 4, 1), order).t()  # [R, C]
        zero = _awq_columns(unpack_levels(self.qzeros, 4, 1), order).t()  # [R, G]
        groups = contiguous_groups(self.shape[1], self.group, levels.device)
        return levels, zero, self.scales.t(), groups


def _awq_columns(levels: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[N, 8 k] levels in word order -> [N, 8 k] in column order."""
    rows, cols = levels.shape
    return levels.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


@define
class PackQuantizedWeight(PackedWeight):
    """A compressed-tensors pack-quantized projection [R, C] as stored (the module docstring)."""

    TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")

    weight_packed: torch.Tensor  # [R, ceil(C / f)] int32
    weight_scale: torch.Tensor  # [R, G] (as stored)
    weight_zero_point: torch.Tensor | None  # [ceil(R / f), G] int32; None: symmetric
    weight_g_idx: torch.Tensor | None  # [C] int32; None: column // group
    bits: int
    group: int  # columns per group (C for the channel strategy)
    columns: int  # C

    def names(self) -> tuple[str, ...]:
        return tuple(name for name in self.TENSORS if getattr(self, name) is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight_packed.shape[0], self.columns

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return dequantize_groups(*self.parts(), dtype)

    def parts(self) -> Parts:
        rows, cols = self.shape
        levels = unpack_levels(self.weight_packed, self.bits, 1)[:, :cols]  # [R, C]
        if self.weight_zero_point is None:
            zero = torch.full_like(self.weight_scale, 1 << (self.bits - 1), dtype=torch.int32)  # [R, G]
        else:
            zero = unpack_levels(self.weight_zero_point, self.bits, 0)[:rows]  # [R, G]
        groups = self.weight_g_idx
        if groups is None:
            groups = contiguous_groups(cols, self.group, levels.device)
        return levels, zero, self.weight_scale, groups


StoredWeight = GPTQWeight | AWQWeight | PackQuantizedWeight


def as_int4(weight: StoredWeight) -> PackedWeight:
    """`weight` in flowmoe's own `Int4Weight` layout, the one the CPU's packed kernels read, where
    that holds exactly its values: 4 bits, groups of consecutive columns (no act-order permutation)
    that are whole multiples of the kernels' 64 columns, and scales float16 holds exactly (GPTQ's
    and AWQ's are float16; a compressed-tensors bfloat16 or float32 scale may not be). The levels
    and zeros are small integers, exact in float16, and both layouts dequantize as (level - zero) x
    scale in float32: the same values, bit for bit. A weight of one group per row (per channel) is
    laid out at `ONE_GROUP_AS` columns a group (64 where its columns are not a multiple of that),
    each group repeating its row's scale and zero, so an expert's projections share one group
    size, as the kernels take them. Anything else: `weight` as it is (dequantized in torch)."""
    if weight.bits != 4:
        return weight
    levels, zero, scale, group_of = weight.parts()  # [R, C], [R, G], [R, G], [C]
    columns, groups = levels.shape[1], scale.shape[1]
    group = weight.group if groups > 1 else ONE_GROUP_AS if columns % ONE_GROUP_AS == 0 else GROUP_STEP
    if group % GROUP_STEP or not torch.equal(
        group_of.long(), contiguous_groups(columns, weight.group, levels.device)
    ):
        return weight  # groups the kernels do not take, or act-order's permuted ones
    half = scale.half()  # [R, G]
    if not torch.equal(half.float(), scale.float()):
        return weight
    repeat = -(-columns // group) // groups  # one group a row: as many as `group` makes
    return Int4Weight(
        pack_int4(levels),
        half.repeat(1, repeat).contiguous(),
        zero.half().repeat(1, repeat).contiguous(),
        group,
        columns,
    )
