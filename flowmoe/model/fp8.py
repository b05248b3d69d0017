"""FP8 checkpoints: `float8_e4m3fn` weights with one float32 scale per block of the weight.

The DeepSeek-V3 / Kimi K2 / Qwen3-FP8 releases (transformers' "fine-grained FP8") store each
quantized `<module>.weight` [R, C] as F8_E4M3 next to `<module>.weight_scale_inv`
[ceil(R / bm), ceil(C / bn)] float32, where `weight_block_size` = [bm, bn] (128 x 128 in every
release). The weight is value x the scale of its block; the last block row and column are
partial when R or C is not a multiple of the block (the release's `kv_a_proj_with_mqa` [576, 7168]
has a [5, 56] grid). A fused expert tensor `<module>.gate_up_proj` [E, R, C] has its scales in
`<module>.gate_up_proj_scale_inv` [E, ceil(R / bm), ceil(C / bn)]. Which tensors are quantized is
read from each tensor's stored dtype; the modules listed in `modules_to_not_convert` must not be.

The loader dequantizes each FP8 tensor into the model's dtype (`dequantize`). Under the policy's
`expert_format: "fp8"` the routed experts are kept as stored instead (`QuantizedExpert`s of
`FP8Weight`s, read by `fp8_experts`; model/quantized.py): a PAGE_COPY moves those bytes and
dequantizes them on the GPU, to the same values (flowmoe/runtime/device_weights.py).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import torch
from attrs import define, frozen

from flowmoe.core.errors import CheckpointError
from flowmoe.model.quantized import PackedWeight, QuantizedExpert
from flowmoe.model.tensor_map import TensorMap

FP8_DTYPE = "F8_E4M3"  # the safetensors name of torch.float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16")
QUANT_FIELD = "quantization_config"


@frozen
class FP8Format:
    """A checkpoint's `quantization_config` of `quant_method: "fp8"`, checked."""

    block: tuple[int, int]  # rows, columns of the weight one scale covers
    not_converted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> FP8Format | None:
        """None for a checkpoint without a quantization config; an error naming the field for one
        flowmoe cannot read."""
        quant = config.get(QUANT_FIELD)
        if quant is None:
            return None
        if not isinstance(quant, dict):
            raise CheckpointError(f'{where}: "{QUANT_FIELD}" must be an object, got {quant!r}')

        def bad(name: str, want: str) -> CheckpointError:
            return CheckpointError(f'{where}: "{QUANT_FIELD}.{name}" {want}, got {quant.get(name)!r}')

        if quant.get("quant_method") != "fp8":  # gptq, awq, compressed-tensors: model/int4_checkpoints.py
            raise bad("quant_method", 'must be "fp8", "gptq", "awq" or "compressed-tensors"')
        if quant.get("fmt", "e4m3") != "e4m3":
            raise bad("fmt", 'must be "e4m3" (float8_e4m3fn weights)')
        if str(quant.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise bad("activation_scheme", 'must be "dynamic" (static activation scales are not applied)')
        if quant.get("scale_fmt", "float") not in ("float", "ue8m0"):
            raise bad("scale_fmt", 'must be "float" or "ue8m0"')
        block = quant.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise bad("weight_block_size", "must be two positive integers [rows, columns]")
        skip = quant.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise bad("modules_to_not_convert", "must be a list of module names")
        return cls((block[0], block[1]), tuple(skip))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """[..., R, C] -> [..., ceil(R / bm), ceil(C / bn)]: partial blocks at the edges."""
        rows, cols = shape[-2:]
        return (*shape[:-2], -(-rows // self.block[0]), -(-cols // self.block[1]))

    def converted(self, name: str) -> bool:
        """Whether the module holding tensor `name` may be quantized (`module_converted`)."""
        return module_converted(name.removesuffix(".weight"), self.not_converted)


def module_converted(module: str, not_converted: tuple[str, ...]) -> bool:
    """Whether `module` may be quantized: transformers' rule for `modules_to_not_convert` (a prefix
    up to a module boundary, a regex with that boundary, or a suffix of the module name)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in not_converted)


def scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`; a fused `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`."""
    return f"{name}_scale_inv"


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight [..., R, C] float8_e4m3fn, scale_inv [..., ceil(R / bm), ceil(C / bn)] ->
    [..., R, C] in `dtype`: each value times its block's scale, computed in float32."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    scale = scale_inv.float().repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)  # [..., >=R, >=C]
    return (weight.float() * scale[..., :rows, :cols]).to(dtype)


@define
class FP8Weight(PackedWeight):
    """One quantized projection as the checkpoint stores it."""

    TENSORS = ("values", "scale_inv")

    values: torch.Tensor  # [R, C] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(R / bm), ceil(C / bn)] float32
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
        return dequantize(self.values, self.scale_inv, self.block, dtype)


class FP8Source(Protocol):
    """A checkpoint's view of its FP8 tensors (flowmoe/model/checkpoint.py)."""

    def has(self, name: str) -> bool: ...

    def fp8_weight(self, name: str) -> FP8Weight | None: ...


def fp8_experts(
    source: FP8Source, tensor_map: TensorMap, layer: int, dtype: torch.dtype
) -> list[QuantizedExpert]:
    """Layer `layer`'s routed experts as stored, each projection F8_E4M3 with its scales, standing
    for the model's `dtype`; the releases' per-expert layout (`experts.{e}.gate_proj.weight`) only."""
    layout = tensor_map.moe_layout(layer, source.has)
    if layout.fused:
        raise CheckpointError(
            f"expert format fp8 reads experts stored one by one, as the FP8 releases do; layer {layer} "
            "stores them fused"
        )
    prefix = f"model.layers.{layer}.{layout.prefix}.experts."
    experts = []
    for e in range(tensor_map.spec.moe.experts):
        weights = []
        for proj in tensor_map.names.expert_proj:
            name = f"{prefix}{e}.{proj}.weight"
            weight = source.fp8_weight(name)
            if weight is None:
                raise CheckpointError(
                    f"expert format fp8 needs FP8 experts, but tensor {name} is not F8_E4M3"
                )
            weights.append(weight)
        gate, up, down = weights
        experts.append(QuantizedExpert((gate, up), down, dtype))
    return experts
