"""Integer-quantized checkpoints: GPTQ, AWQ (GEMM) and compressed-tensors pack-quantized, read in the
layouts their quantizers write (model/int4_weights.py; docs/quantized-checkpoints.md names the
sources of each).

`Int4Format` is a checkpoint's `quantization_config`, checked field by field. Which modules are
quantized is read from the shards: module `M` is stored quantized where `M.qweight` (GPTQ, AWQ) or
`M.weight_packed` (compressed-tensors) is, in place of `M.weight`; its tensors' dtypes and shapes
are checked against the shape the model needs of `M.weight` before any weight is read. Modules
the config leaves unconverted (`modules_to_not_convert`, compressed-tensors' `ignore`) must not be.

On load every quantized tensor is dequantized into the model's dtype, the attention, dense and
shared-expert projections included; under `--expert-format int4` (int8 for an 8-bit checkpoint)
the routed experts are kept as stored instead (`int4_experts`), packed in host memory and across
the link, dequantized where they are used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from flowmoe.core.errors import CheckpointError
from flowmoe.core.policy import ExpertFormat
from flowmoe.model.fp8 import QUANT_FIELD, SCALE_DTYPES, module_converted
from flowmoe.model.int4_weights import AWQWeight, GPTQWeight, PackQuantizedWeight, StoredWeight, as_int4
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.shard_header import TensorInfo
from flowmoe.model.tensor_map import Shape, TensorMap

METHODS = ("gptq", "awq", "compressed-tensors")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what a stored zero is short of
INT32 = ("I32",)
FIRST = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}  # marks a module
ACT_ORDERS = (None, False, "weight", "static", "group")  # compressed-tensors' actorder values

Tensor = Callable[[str], torch.Tensor]  # a stored tensor by name


@frozen
class Int4Format:
    """A checkpoint's `quantization_config` of quant_method gptq, awq or compressed-tensors."""

    method: str
    bits: int  # 4, or 8 (GPTQ, compressed-tensors)
    group: int  # input columns per scale; -1: one group per row (per channel)
    act_order: bool  # a g_idx gives each input column's group (GPTQ desc_act, actorder "group")
    symmetric: bool
    zero_offset: int = 0  # GPTQ: 1 where stored zeros are one short (v1), 0 (v2)
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> Int4Format | None:
        """None for a checkpoint without a quantization config of these methods; an error naming
        the field for one flowmoe cannot read."""
        quant = config.get(QUANT_FIELD)
        if not isinstance(quant, dict) or quant.get("quant_method") not in METHODS:
            return None
        if quant["quant_method"] == "compressed-tensors":
            return _compressed_tensors(quant, where)
        return _gptq(quant, where) if quant["quant_method"] == "gptq" else _awq(quant, where)

    @property
    def expert_format(self) -> ExpertFormat:
        """The expert format that keeps these experts as stored."""
        return "int4" if self.bits == 4 else "int8"

    def describe(self) -> str:
        group = "per channel" if self.group < 0 else f"group {self.group}"
        parts = [f"{self.method} {self.bits}-bit", group, "symmetric" if self.symmetric else "asymmetric"]
        if self.act_order:
            parts.append("act-order")
        if self.method == "gptq":
            parts.append("v1 zeros" if self.zero_offset else "v2 zeros")
        return ", ".join(parts)

    def stored(self, name: str, has: Callable[[str], bool]) -> bool:
        """Whether tensor `name` (`M.weight`) is stored quantized, as module M's tensors."""
        module = name.removesuffix(".weight")
        return module != name and has(f"{module}.{FIRST[self.method]}")

    def converted(self, module: str) -> bool:
        if self.method != "compressed-tensors":
            return module_converted(module, self.not_converted)
        # compressed-tensors' rule: a name, or "re:" and a regex matched from the start
        return not any(
            re.match(key[3:], module) if key.startswith("re:") else key == module
            for key in self.not_converted
        )

    def expected(self, module: str, shape: Shape) -> dict[str, tuple[Shape, tuple[str, ...], bool]]:
        """Module `module`'s tensors for a weight [R, C]: name -> (shape, dtypes, required)."""
        rows, cols = shape
        per_word = 32 // self.bits
        groups = 1 if self.group < 0 else math.ceil(cols / self.group)
        g_idx = (cols,), INT32, self.act_order
        m = f"{module}."
        if self.method == "gptq":
            return {
                f"{m}qweight": ((cols // per_word, rows), INT32, True),
                f"{m}qzeros": ((groups, rows // per_word), INT32, True),
                f"{m}scales": ((groups, rows), SCALE_DTYPES, True),
                f"{m}g_idx": g_idx,
            }
        if self.method == "awq":
            return {
                f"{m}qweight": ((cols, rows // per_word), INT32, True),
                f"{m}qzeros": ((groups, rows // per_word), INT32, True),
                f"{m}scales": ((groups, rows), SCALE_DTYPES, True),
            }
        return {
            f"{m}weight_packed": ((rows, math.ceil(cols / per_word)), INT32, True),
            f"{m}weight_scale": ((rows, groups), SCALE_DTYPES, True),
            f"{m}weight_zero_point": ((math.ceil(rows / per_word), groups), INT32, not self.symmetric),
            f"{m}weight_g_idx": g_idx,
            f"{m}weight_shape": ((2,), INT32, False),
        }

    def check(
        self, name: str, shape: Shape, info: Mapping[str, TensorInfo], where: Mapping[str, Path]
    ) -> None:
        """Module M of tensor `name` (M.weight, [R, C]) as stored: every tensor it needs present, of
        its dtype and shape, from the shard headers alone."""
        module = name.removesuffix(".weight")
        shard = where[f"{module}.{FIRST[self.method]}"]
        if not self.converted(module):
            raise CheckpointError(
                f"{shard}: module {module} is stored quantized ({self.method}), but the quantization_config "
                "leaves it unconverted (modules_to_not_convert / ignore)"
            )
        rows, cols = shape
        per_word, divides = 32 // self.bits, _divides(self, rows, cols)
        if divides:
            raise CheckpointError(f"{shard}: module {module} [{rows}, {cols}]: {divides}")
        for tensor, (want, dtypes, required) in self.expected(module, shape).items():
            if tensor not in info:
                if required:
                    raise CheckpointError(
                        f"{shard}: tensor {tensor} is missing ({self.method} module {module} needs it)"
                    )
                continue
            got = info[tensor]
            if got.shape != want:
                raise CheckpointError(
                    f"{where[tensor]}: tensor {tensor} has shape {list(got.shape)}, expected {list(want)} "
                    f"({self.describe()}, {per_word} levels per int32, for {module} [{rows}, {cols}])"
                )
            if got.dtype not in dtypes:
                raise CheckpointError(
                    f"{where[tensor]}: tensor {tensor} has dtype {got.dtype}, expected {' or '.join(dtypes)}"
                )

    def read(self, name: str, shape: Shape, tensor: Tensor, has: Callable[[str], bool]) -> StoredWeight:
        """Module M of tensor `name` (checked by `check`) as stored."""
        module = name.removesuffix(".weight")
        rows, cols = shape
        group = cols if self.group < 0 else self.group
        groups = 1 if self.group < 0 else math.ceil(cols / self.group)

        def g_idx(suffix: str) -> torch.Tensor | None:
            if not self.act_order:
                return None
            index = tensor(f"{module}.{suffix}")
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= groups):
                raise CheckpointError(
                    f"tensor {module}.{suffix} gives groups outside 0..{groups - 1} ({module} has {groups})"
                )
            return index

        if self.method != "compressed-tensors":
            qweight, qzeros, scales = (tensor(f"{module}.{t}") for t in ("qweight", "qzeros", "scales"))
            if self.method == "awq":
                return AWQWeight(qweight, qzeros, scales, group)
            return GPTQWeight(qweight, qzeros, scales, g_idx("g_idx"), self.bits, group, self.zero_offset)
        stored_shape = f"{module}.weight_shape"
        if has(stored_shape) and tensor(stored_shape).tolist() != [rows, cols]:
            raise CheckpointError(
                f"tensor {stored_shape} holds {tensor(stored_shape).tolist()}, expected [{rows}, {cols}]"
            )
        zero = tensor(f"{module}.weight_zero_point") if not self.symmetric else None
        packed, scale = tensor(f"{module}.weight_packed"), tensor(f"{module}.weight_scale")
        return PackQuantizedWeight(packed, scale, zero, g_idx("weight_g_idx"), self.bits, group, cols)


def _divides(fmt: Int4Format, rows: int, cols: int) -> str:
    """Why a [rows, cols] weight cannot be stored in `fmt`, or ""."""
    per_word = 32 // fmt.bits
    if fmt.method == "gptq" and (rows % per_word or cols % per_word):
        return f"GPTQ packs {per_word} levels per int32 along both dimensions"
    if fmt.method == "awq" and rows % per_word:
        return f"AWQ packs {per_word} levels per int32 along the output rows"
    if fmt.method != "gptq" and fmt.group > 0 and cols % fmt.group:
        return f"{fmt.method} groups need the {cols} input columns to be a multiple of group_size {fmt.group}"
    return ""


def _field(quant: dict[str, Any], where: str) -> Callable[[str, str], CheckpointError]:
    def bad(name: str, want: str) -> CheckpointError:
        value = quant
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None  # type: ignore[assignment]
        return CheckpointError(f'{where}: "{QUANT_FIELD}.{name}" {want}, got {value!r}')

    return bad


def _skipped(quant: dict[str, Any], key: str, bad: Callable[[str, str], CheckpointError]) -> tuple[str, ...]:
    skip = quant.get(key) or []
    if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise bad(key, "must be a list of module names")
    return tuple(skip)


def _group(value: Any) -> bool:
    return type(value) is int and (value == -1 or value > 0)


def _gptq(quant: dict[str, Any], where: str) -> Int4Format:
    bad = _field(quant, where)
    if quant.get("bits") not in (4, 8) or type(quant.get("bits")) is not int:
        raise bad("bits", "must be 4 or 8 (GPTQ's 2- and 3-bit packings are not read)")
    if not _group(quant.get("group_size")):
        raise bad("group_size", "must be -1 (per channel) or a positive number of columns")
    for flag, default in (("desc_act", False), ("sym", True)):
        if type(quant.get(flag, default)) is not bool:
            raise bad(flag, "must be true or false")
    key = "checkpoint_format" if "checkpoint_format" in quant else "format"
    if quant.get(key, "gptq") not in GPTQ_FORMATS:
        raise bad(key, 'must be "gptq" (v1 zeros, as published checkpoints store them) or "gptq_v2"')
    if quant.get("is_marlin_format"):
        raise bad("is_marlin_format", "must be false (Marlin's repacked layout is not read)")
    if quant.get("dynamic"):
        raise bad("dynamic", "must be empty (per-module bits and group sizes are not read)")
    return Int4Format(
        "gptq", quant["bits"], quant["group_size"], quant.get("desc_act", False), quant.get("sym", True),
        GPTQ_FORMATS[quant.get(key, "gptq")], _skipped(quant, "modules_to_not_convert", bad),
    )  # fmt: skip


def _awq(quant: dict[str, Any], where: str) -> Int4Format:
    bad = _field(quant, where)
    if quant.get("bits") != 4 or type(quant.get("bits")) is not int:
        raise bad("bits", "must be 4 (AWQ's GEMM packing)")
    if not _group(quant.get("group_size")):
        raise bad("group_size", "must be -1 (per channel) or a positive number of columns")
    if str(quant.get("version", "gemm")).lower() != "gemm":
        raise bad("version", 'must be "gemm" (the GEMV, exllama and ipex packings are not read)')
    if quant.get("zero_point", True) is not True:
        raise bad("zero_point", "must be true (AWQ's GEMM layout stores zeros)")
    skip = _skipped(quant, "modules_to_not_convert", bad)
    return Int4Format("awq", 4, quant["group_size"], False, False, 0, skip)


def _compressed_tensors(quant: dict[str, Any], where: str) -> Int4Format:
    bad = _field(quant, where)
    if quant.get("format") != "pack-quantized":
        raise bad("format", 'must be "pack-quantized" (int weights packed into int32)')
    groups = quant.get("config_groups")
    if not (isinstance(groups, dict) and groups and all(isinstance(g, dict) for g in groups.values())):
        raise bad("config_groups", "must be an object of quantization schemes")
    schemes = []
    for name, scheme in groups.items():
        at = f"config_groups.{name}"
        if scheme.get("format", "pack-quantized") != "pack-quantized":
            raise bad(f"{at}.format", 'must be "pack-quantized"')
        if scheme.get("input_activations") is not None:
            raise bad(f"{at}.input_activations", "must be null (weight-only W4A16 / W8A16)")
        weights = scheme.get("weights")
        if not isinstance(weights, dict):
            raise bad(f"{at}.weights", "must be an object")
        schemes.append(_ct_weights(weights, f"{at}.weights", bad))
    if len(set(schemes)) > 1:
        raise bad("config_groups", "must give every group the same weight scheme")
    bits, group, act_order, symmetric = schemes[0]
    skip = _skipped(quant, "ignore", bad)
    return Int4Format("compressed-tensors", bits, group, act_order, symmetric, 0, skip)


def _ct_weights(
    weights: dict[str, Any], at: str, bad: Callable[[str, str], CheckpointError]
) -> tuple[int, int, bool, bool]:
    """A compressed-tensors weight scheme -> (bits, group or -1, act-order, symmetric)."""
    if weights.get("num_bits") not in (4, 8) or type(weights.get("num_bits")) is not int:
        raise bad(f"{at}.num_bits", "must be 4 or 8")
    if weights.get("type", "int") != "int":
        raise bad(f"{at}.type", 'must be "int"')
    if weights.get("dynamic", False) is not False:
        raise bad(f"{at}.dynamic", "must be false")
    if type(weights.get("symmetric", True)) is not bool:
        raise bad(f"{at}.symmetric", "must be true or false")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise bad(f"{at}.strategy", 'must be "group" or "channel"')
    group = weights.get("group_size") if strategy == "group" else -1
    if not (type(group) is int and (group > 0 or strategy == "channel")):
        raise bad(f"{at}.group_size", "must be a positive number of columns")
    if weights.get("actorder") not in ACT_ORDERS:
        raise bad(f"{at}.actorder", 'must be null, "weight", "static" or "group"')
    return weights["num_bits"], group, weights.get("actorder") == "group", weights.get("symmetric", True)


def int4_experts(
    fmt: Int4Format,
    tensor: Tensor,
    has: Callable[[str], bool],
    tensor_map: TensorMap,
    layer: int,
    dtype: torch.dtype,
) -> list[QuantizedExpert]:
    """Layer `layer`'s routed experts as stored, standing for the model's `dtype`, each projection in
    flowmoe's own int4 layout where that holds its values exactly (`as_int4`: the CPU's packed
    kernels read it); experts stored one by one (`experts.{e}.gate_proj`), as these quantizers
    write them."""
    layout = tensor_map.moe_layout(layer, has)
    form = fmt.expert_format
    if layout.fused:
        raise CheckpointError(
            f"expert format {form} reads experts stored one by one; layer {layer} stores them fused"
        )
    shapes = tensor_map.layer_tensors(layer, has)
    prefix = f"model.layers.{layer}.{layout.prefix}.experts."
    experts = []
    for e in range(tensor_map.spec.moe.experts):
        weights = []
        for proj in tensor_map.names.expert_proj:
            name = f"{prefix}{e}.{proj}.weight"
            if not fmt.stored(name, has):
                raise CheckpointError(
                    f"expert format {form} keeps the experts as the {fmt.method} checkpoint stores them, but "
                    f"tensor {name} is not quantized"
                )
            weights.append(as_int4(fmt.read(name, shapes[name], tensor, has)))
        gate, up, down = weights
        experts.append(QuantizedExpert((gate, up), down, dtype))
    return experts
