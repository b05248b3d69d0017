"""Hugging Face checkpoint folders: config.json plus one or many memory-mapped safetensors shards.

Opening a checkpoint reads only the shard headers and checks every tensor the
model needs (present, right shape, floating dtype) before any weight is read,
so a bad checkpoint fails at once with one line naming the file and tensor.
Weights are then read lazily, a layer at a time, straight from the mapped files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from attrs import define, field
from safetensors import safe_open

from flowmoe.core.errors import CheckpointError
from flowmoe.core.spec import ModelSpec
from flowmoe.model.tensor_map import Shape, TensorMap

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "F16", "BF16"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@define
class Checkpoint:
    """A checkpoint folder opened for lazy reading; implements TensorSource."""

    folder: Path
    spec: ModelSpec
    dtype: torch.dtype
    _where: dict[str, Path] = field(factory=dict)  # tensor name -> shard file
    _handles: dict[Path, Any] = field(factory=dict)
    _stack: ExitStack = field(factory=ExitStack)

    @classmethod
    def open(cls, folder: str | Path, dtype: str | None = None) -> Checkpoint:
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: checkpoint folder not found")
        spec = ModelSpec.from_hf(folder / "config.json")
        if dtype is not None:
            spec = spec.with_dtype(dtype)
        ckpt = cls(folder, spec, TORCH_DTYPES[spec.dtype])
        weight_map = ckpt._weight_map()
        for shard in ckpt._shards(weight_map):
            handle = ckpt._stack.enter_context(safe_open(str(shard), framework="pt"))
            ckpt._handles[shard] = handle
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                ckpt._where.setdefault(name, shard)
        ckpt._check_index_names(weight_map)
        ckpt.validate()
        return ckpt

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def _weight_map(self) -> dict[str, str] | None:
        """The index's tensor -> shard map, or None for a checkpoint without an index."""
        index = self.folder / INDEX
        if not index.is_file():
            return None
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc

    def _shards(self, weight_map: dict[str, str] | None) -> list[Path]:
        if weight_map is not None:
            shards = sorted({self.folder / f for f in weight_map.values()})
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"{shard}: shard listed in {INDEX} is missing")
            return shards
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.folder}: no *.safetensors files and no {INDEX}")
        return shards

    def _check_index_names(self, weight_map: dict[str, str] | None) -> None:
        for name, file in (weight_map or {}).items():
            if name not in self._where:
                raise CheckpointError(
                    f"{self.folder / file}: tensor {name} listed in {INDEX} is not in the shard"
                )

    # ---- TensorSource

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        self._check(name, shape)
        tensor = self._handles[self._where[name]].get_tensor(name)
        return tensor.to(self.dtype).contiguous()

    # ---- validation

    def _check(self, name: str, shape: Shape) -> None:
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        shard = self._where[name]
        info = self._handles[shard].get_slice(name)
        found = tuple(info.get_shape())
        if found != tuple(shape):
            raise CheckpointError(f"{shard}: tensor {name} has shape {list(found)}, expected {list(shape)}")
        if info.get_dtype() not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{shard}: tensor {name} has dtype {info.get_dtype()}, expected one of F32, F16, BF16"
            )

    def expected(self) -> Iterator[tuple[str, Shape]]:
        tensor_map = TensorMap.for_spec(self.spec)
        yield from tensor_map.top_level().items()
        for layer in range(self.spec.layers):
            try:
                tensors = tensor_map.layer_tensors(layer, self.has)
            except CheckpointError as exc:
                raise CheckpointError(f"{self.folder}: {exc}") from exc
            yield from tensors.items()

    def validate(self) -> None:
        for name, shape in self.expected():
            self._check(name, shape)
