"""Turn a checkpoint folder or a preset name into a ready MoEModel."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from attrs import frozen

from flowmoe.core.errors import CheckpointError, ConfigError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.core.policy import ExpertFormat
from flowmoe.core.presets import PRESETS, preset
from flowmoe.model.arena import layer_arena, plan_layer, top_arena
from flowmoe.model.checkpoint import TORCH_DTYPES, Checkpoint
from flowmoe.model.int4_checkpoints import Int4Format
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quantize import quantize_expert
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import Shape, TensorMap, TensorSource

Progress = Callable[[int, int], None]


def load_model(
    source: str | Path,
    dtype: str | None = None,
    layers: int | None = None,
    progress: Progress | None = None,
) -> MoEModel:
    """`source` is a checkpoint folder or a preset name (random weights at the real shapes).

    `layers` cuts a preset to its first layers; `progress(done, total)` is called per layer."""
    path = Path(source)
    if path.exists() or path.is_symlink():  # a folder, or something in its place to name
        if layers is not None:
            raise ConfigError("--layers applies to presets only; a checkpoint loads all its layers")
        ckpt = Checkpoint.open(path, dtype)
        return _assemble(ckpt, ckpt.spec, progress)
    if str(source) in PRESETS:
        spec = preset(str(source), layers=layers, dtype=dtype)
        return _assemble(RandomSource(spec), spec, progress)
    raise ConfigError(f"{source}: neither a checkpoint folder nor a preset (presets: {', '.join(PRESETS)})")


def pack_experts(
    model: MoEModel, source: str | Path, expert_format: ExpertFormat, device: torch.device | None = None
) -> None:
    """Keep every MoE layer's routed experts packed in `expert_format` (model/quantized.py), and
    only so: fp8 as the FP8 checkpoint `source` stores them; int4 (int8) as a GPTQ, AWQ or
    compressed-tensors checkpoint of that many bits stores them (model/int4_checkpoints.py); else
    int8, int4 and hqq4 quantized from the experts `model` loaded from `source` in its own dtype (a
    checkpoint or a preset), on `device` (default: the CPU). Each layer is packed into its host
    buffer again (model/arena.py)."""
    if expert_format == "native":
        return
    if expert_format == "fp8":
        packs = _fp8_experts(model, source)
    elif (stored := stored_quantization(source)) is not None:
        packs = _int4_experts(model, source, expert_format, stored)
    else:
        _check_quantizable(source, expert_format)
        if any(lw.packed for lw in model.weights.layers):
            raise ConfigError(f"--expert-format {expert_format}: the model's experts are packed already")
        where = device or torch.device("cpu")
        packs = {
            layer: [quantize_expert(ffn, expert_format, where) for ffn in lw.experts]
            for layer, lw in enumerate(model.weights.layers)
            if lw.router is not None
        }
    for layer, packed in packs.items():
        lw = model.weights.layers[layer]
        lw.packed, lw.experts = packed, []
        layer_arena(lw)


def _fp8_experts(model: MoEModel, folder: str | Path) -> dict[int, list[QuantizedExpert]]:
    """Each MoE layer's routed experts as the FP8 checkpoint at `folder` stores them."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"--expert-format fp8 needs an FP8 checkpoint folder, and {folder} is not one")
    ckpt = Checkpoint.open(path, model.spec.dtype)
    try:
        if ckpt.fp8 is None:
            raise ConfigError(
                f"--expert-format fp8 needs an FP8 checkpoint; {path / 'config.json'} has no "
                'quantization_config of quant_method "fp8"'
            )
        layers = model.weights.layers
        return {layer: ckpt.fp8_experts(layer) for layer, lw in enumerate(layers) if lw.router is not None}
    finally:
        ckpt.close()


def stored_quantization(source: str | Path) -> Int4Format | None:
    """The quantization of a GPTQ, AWQ or compressed-tensors checkpoint folder (None for another
    checkpoint or a preset), read from its config alone."""
    path = Path(source)
    if not path.is_dir():
        return None
    config = path / "config.json"
    return Int4Format.from_config(read_json_object(config, CheckpointError), str(config))


def _int4_experts(
    model: MoEModel, folder: str | Path, expert_format: ExpertFormat, stored: Int4Format
) -> dict[int, list[QuantizedExpert]]:
    """Each MoE layer's routed experts as the integer checkpoint at `folder` stores them, where
    `expert_format` is the one that keeps them so."""
    if expert_format != stored.expert_format:
        raise ConfigError(
            f"--expert-format {expert_format}: {folder} is a {stored.describe()} checkpoint; run it with "
            f"--expert-format {stored.expert_format} (its experts as stored) or native (dequantized on load)"
        )
    ckpt = Checkpoint.open(folder, model.spec.dtype)
    try:
        layers = model.weights.layers
        return {layer: ckpt.int4_experts(layer) for layer, lw in enumerate(layers) if lw.router is not None}
    finally:
        ckpt.close()


def _check_quantizable(source: str | Path, expert_format: ExpertFormat) -> None:
    """Quantize-on-load takes weights in the model's own dtype: not an FP8 checkpoint's."""
    path = Path(source)
    if not path.is_dir():  # a preset: random weights in its dtype
        return
    ckpt = Checkpoint.open(path)
    fp8 = ckpt.fp8 is not None
    ckpt.close()
    if fp8:
        raise ConfigError(
            f"--expert-format {expert_format} quantizes a checkpoint in bfloat16, float16 or float32 as it "
            f"loads, and {path} is an FP8 checkpoint: run it with --expert-format fp8 (or native)"
        )


@frozen
class _Shapes:
    """`source`'s tensors as meta tensors of the model's dtype: shapes, no data (a TensorSource)."""

    source: TensorSource
    dtype: torch.dtype

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device="meta")


def _assemble(source: TensorSource, spec, progress: Progress | None) -> MoEModel:
    """Each layer into its arena as it is read: laid out from its shapes first, so its stacked
    tensors are written in place and the rest copied in one by one (model/arena.py)."""
    tensor_map = TensorMap.for_spec(spec)
    shapes = _Shapes(source, TORCH_DTYPES[spec.dtype])
    layers = []
    for layer in range(spec.layers):
        plan = plan_layer(functools.partial(tensor_map.load_layer, layer, shapes))
        lw = tensor_map.load_layer(layer, source, plan.stack)
        layer_arena(lw, plan)  # each loaded tensor is let go as its copy takes its place
        layers.append(lw)
        if progress is not None:
            progress(layer + 1, spec.layers)
    weights = tensor_map.load_top(source, layers)
    top_arena(weights)
    return MoEModel.build(spec, weights)
