"""Turn a checkpoint folder or a preset name into a ready MoEModel."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flowmoe.core.errors import ConfigError
from flowmoe.core.presets import PRESETS, preset
from flowmoe.model.arena import layer_arena, top_arena
from flowmoe.model.checkpoint import Checkpoint
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import TensorMap, TensorSource

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


def keep_fp8_experts(model: MoEModel, folder: str | Path) -> None:
    """Expert format fp8: every MoE layer of `model` (loaded from `folder`) also keeps its routed
    experts as the FP8 checkpoint stores them, the copies that cross the link."""
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
        for layer, lw in enumerate(model.weights.layers):
            if lw.experts:
                lw.fp8_experts = ckpt.fp8_experts(layer)
                layer_arena(lw)  # packed again with its FP8 copies
    finally:
        ckpt.close()


def _assemble(source: TensorSource, spec, progress: Progress | None) -> MoEModel:
    tensor_map = TensorMap.for_spec(spec)
    layers = []
    for layer in range(spec.layers):
        lw = tensor_map.load_layer(layer, source)
        layer_arena(lw)  # the loaded tensors are freed as their copies take their place
        layers.append(lw)
        if progress is not None:
            progress(layer + 1, spec.layers)
    weights = tensor_map.load_top(source, layers)
    top_arena(weights)
    return MoEModel.build(spec, weights)
