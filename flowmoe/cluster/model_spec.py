"""The driver's view of the model: its spec (vocabulary, context, EOS ids) without its weights.

The driver tokenises and checks every request, which needs only the spec; the weights are loaded
by each replica, so the driver's host holds no extra copy of the model."""

from __future__ import annotations

from pathlib import Path

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.presets import PRESETS, preset
from flowmoe.core.spec import ModelSpec
from flowmoe.model.checkpoint import Checkpoint


@frozen
class SpecOnly:
    """Stands for the model where only its spec is read (`build_requests`, `JobSpec.limits`)."""

    spec: ModelSpec


def model_spec(source: str, dtype: str | None, layers: int | None) -> SpecOnly:
    """A checkpoint folder's spec (its shards checked, no weight read) or a preset's, with the
    same refusals as `load_model`."""
    path = Path(source)
    if path.exists() or path.is_symlink():
        if layers is not None:
            raise ConfigError("--layers applies to presets only; a checkpoint loads all its layers")
        checkpoint = Checkpoint.open(path, dtype)
        checkpoint.close()
        return SpecOnly(checkpoint.spec)
    if source in PRESETS:
        return SpecOnly(preset(source, layers=layers, dtype=dtype))
    raise ConfigError(f"{source}: neither a checkpoint folder nor a preset (presets: {', '.join(PRESETS)})")
