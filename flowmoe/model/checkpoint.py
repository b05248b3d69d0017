"""Hugging Face checkpoint folders: config.json plus one or many memory-mapped safetensors shards.

Opening a checkpoint reads only the shard headers and checks every tensor the
model needs (present, right shape, floating dtype) before any weight is read,
so a bad checkpoint fails at once with one line naming the file and tensor.
Weights are then read lazily, a layer at a time: a float tensor comes back (`read`) as a view of
its own private mapping of its bytes, which the page cache fills as it is read and which is
unmapped when the view goes, so copying it into its layer's arena (model/arena.py), converted to
the model's dtype on the way where it is stored in another, is the one copy the load makes and the
file's pages do not stay in the process (issue 25: a mapping of the whole shard, kept open, held
every weight twice in its resident set; a tensor converted into a buffer of its own first held it
once more until copied in).
An FP8 checkpoint (flowmoe/model/fp8.py) has its F8_E4M3 tensors' block scales checked up
front too, and each is dequantized into the model's dtype as its layer is read; so has a GPTQ, AWQ
or compressed-tensors checkpoint its modules' packed integer tensors (model/int4_checkpoints.py).

The index (`model.safetensors.index.json`) may only name files inside the folder,
judged by their spelling (no absolute path, no `..`); the files themselves may be
links, as in a Hugging Face cache snapshot. It also decides which shard a tensor
comes from; a tensor in two shards that it does not place is an error.
"""

from __future__ import annotations

import functools
import mmap
import posixpath
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from attrs import define, field
from safetensors import SafetensorError, safe_open

from flowmoe.core.bounded_read import INDEX as INDEX_BOUND
from flowmoe.core.errors import CheckpointError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.core.os_errors import os_reason
from flowmoe.core.spec import ModelSpec
from flowmoe.kernels.host_memory import huge_empty
from flowmoe.model.arena import copy_in
from flowmoe.model.file_rows import FileRows
from flowmoe.model.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPES,
    FP8Format,
    FP8Weight,
    dequantize,
    fp8_experts,
    scale_name,
)
from flowmoe.model.int4_checkpoints import Int4Format, int4_experts
from flowmoe.model.quantized import PackedWeight, QuantizedExpert
from flowmoe.model.shard_header import TensorInfo, read_header
from flowmoe.model.tensor_map import Shape, TensorMap

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "F16", "BF16"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


SIZE_SLACK = 8  # the spec's dtype (or --dtype) over fp8 or other narrower stored weights


@define
class Checkpoint:
    """A checkpoint folder opened for lazy reading; implements TensorSource."""

    folder: Path
    spec: ModelSpec
    dtype: torch.dtype
    _where: dict[str, Path] = field(factory=dict)  # tensor name -> shard file
    _info: dict[str, TensorInfo] = field(factory=dict)  # tensor name -> dtype and shape
    _handles: dict[Path, Any] = field(factory=dict)
    _stack: ExitStack = field(factory=ExitStack)
    fp8: FP8Format | None = None  # config.json's fp8 quantization_config, if any
    int4: Int4Format | None = None  # its gptq, awq or compressed-tensors one, if any

    @classmethod
    def open(cls, folder: str | Path, dtype: str | None = None) -> Checkpoint:
        folder = Path(folder)
        _check_folder(folder)
        spec = ModelSpec.from_hf(folder)
        if dtype is not None:
            spec = spec.with_dtype(dtype)
        config = folder / "config.json"
        raw = read_json_object(config, CheckpointError)
        int4 = Int4Format.from_config(raw, str(config))
        fp8 = FP8Format.from_config(raw, str(config)) if int4 is None else None
        ckpt = cls(folder, spec, TORCH_DTYPES[spec.dtype], fp8=fp8, int4=int4)
        try:
            ckpt._locate(ckpt._weight_map())
            ckpt._check_size()
            ckpt.validate()
        except BaseException:
            ckpt.close()
            raise
        return ckpt

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def _weight_map(self) -> dict[str, Path] | None:
        """The index's tensor -> shard map, or None for a checkpoint without an index."""
        index = self.folder / INDEX
        if not index.exists() and not index.is_symlink():
            return None
        weight_map = read_json_object(index, CheckpointError, INDEX_BOUND).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f'{index}: "weight_map" must be an object of tensor name -> shard file')
        return {name: self._inside(file) for name, file in weight_map.items()}

    def _inside(self, entry: str) -> Path:
        """An index entry as a file of the folder, judged by its spelling: an absolute path or one
        that climbs out with `..` is refused (the file itself may be a link, as in the HF cache)."""
        normal = posixpath.normpath(entry)
        if not entry or "\0" in entry or posixpath.isabs(normal) or normal.split("/")[0] in ("..", "."):
            raise CheckpointError(
                f"{self.folder / INDEX}: shard {entry!r} is not a file inside the checkpoint folder"
            )
        return self.folder / normal

    def _locate(self, weight_map: dict[str, Path] | None) -> None:
        """Where each tensor lives: the index decides; a tensor it does not place must be in one
        shard only."""
        shards = self._shards(weight_map)
        headers = {shard: read_header(shard) for shard in shards}
        found: dict[str, list[Path]] = {}
        for shard, header in headers.items():
            for name in header:
                found.setdefault(name, []).append(shard)
        for name, shard in (weight_map or {}).items():
            if name not in headers[shard]:
                raise CheckpointError(f"{shard}: tensor {name} listed in {INDEX} is not in the shard")
        for name, where in found.items():
            placed = (weight_map or {}).get(name)
            if placed is None and len(where) > 1:
                settle = f"{INDEX} does not place it" if weight_map is not None else f"there is no {INDEX}"
                raise CheckpointError(f"tensor {name} is in both {where[0]} and {where[1]}, and {settle}")
            self._where[name] = placed or where[0]
            self._info[name] = headers[self._where[name]][name]
        for shard in sorted(set(self._where.values())):
            try:
                self._handles[shard] = self._stack.enter_context(safe_open(str(shard), framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{shard}: not a readable safetensors file ({exc})") from exc

    def _check_size(self) -> None:
        """The weights config.json describes must be about what the shards hold, checked before the
        tensor names of every layer and expert are listed (a config claiming 10**9 experts)."""
        stored = sum(shard.stat().st_size for shard in set(self._where.values()))
        claimed = self.spec.total_bytes
        if claimed > SIZE_SLACK * stored + 2**26:
            raise CheckpointError(
                f"{self.folder / 'config.json'}: describes {claimed / 2**30:.3g} GiB of weights but the "
                f"shards hold {stored / 2**30:.3g} GiB; check its sizes (layers, experts, hidden, vocab)"
            )

    def _shards(self, weight_map: dict[str, Path] | None) -> list[Path]:
        if weight_map is not None:
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not shard.exists() and not shard.is_symlink():
                    raise CheckpointError(f"{shard}: shard listed in {INDEX} is missing")
            return shards
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.folder}: no *.safetensors files and no {INDEX}")
        return shards

    # ---- TensorSource

    def has(self, name: str) -> bool:
        """Whether tensor `name` is stored, or its module as an integer checkpoint's packed tensors."""
        stored = self._where.__contains__
        return stored(name) or (self.int4 is not None and self.int4.stored(name, stored))

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        tensor = self.read(name, shape)
        if tensor.dtype == self.dtype:
            return tensor
        # converted into memory of its own mapping (freed to the system, not the allocator's pools)
        return copy_in(
            huge_empty(tensor.numel() * self.dtype.itemsize).view(self.dtype).view(tensor.shape), tensor
        )

    def read(self, name: str, shape: Shape) -> torch.Tensor:
        """Tensor `name` for copying into an arena (model/loading.py): a float tensor as stored, viewing
        its own mapping (`_mapped`), so the copy converts it to the model's dtype a chunk at a time
        (arena.copy_in) and no converted copy is ever resident beside the arena; one that cannot be
        mapped, or is stored quantized, in the model's dtype as `get` gives it."""
        self._check(name, shape)
        packed = self.int4_weight(name, shape)
        if packed is not None:  # dequantized per module on load
            return packed.dequantize(self.dtype).contiguous()
        info = self._info[name]
        if self.fp8 is not None and info.dtype == FP8_DTYPE:  # dequantized per tensor on load
            tensor = self._handles[self._where[name]].get_tensor(name)
            scales = self._handles[self._where[scale_name(name)]].get_tensor(scale_name(name))
            return dequantize(tensor, scales, self.fp8.block, self.dtype).contiguous()
        stored = STORED_DTYPES[info.dtype]
        if info.nbytes == 0 or info.offset % stored.itemsize:  # nothing to map, or unaligned: a copy
            return self._handles[self._where[name]].get_tensor(name).to(self.dtype).contiguous()
        return self._mapped(name, stored)

    def _mapped(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` viewing a private mapping of its bytes alone (copy-on-write: the file is
        never written), unmapped when the last view of it goes."""
        info = self._info[name]
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        with open(self._where[name], "rb") as file:
            region = mmap.mmap(
                file.fileno(), info.offset + info.nbytes - start, access=mmap.ACCESS_COPY, offset=start
            )
        flat = torch.frombuffer(region, dtype=torch.uint8, count=info.nbytes, offset=info.offset - start)
        tensor = flat.view(dtype).view(info.shape)  # keeps `region` alive
        # what has been copied out can leave the process's resident set now (model/arena.py copies a
        # large tensor so, a chunk at a time): its bytes [begin, end)
        tensor.release = functools.partial(_drop_pages, region, info.offset - start)  # type: ignore[attr-defined]
        # a table whose rows a step reads (the embedding left here), from the file, not the mapping
        if len(info.shape) == 2:
            rows, cols = info.shape
            tensor.rows = FileRows(self._where[name], info.offset, (rows, cols), dtype)  # type: ignore[attr-defined]
        return tensor

    def fp8_weight(self, name: str) -> FP8Weight | None:
        """Tensor `name` as stored, if it is F8_E4M3 (checked by `validate`), with its block scales."""
        if self.fp8 is None or name not in self._where or self._info[name].dtype != FP8_DTYPE:
            return None
        scales = scale_name(name)
        values = self._handles[self._where[name]].get_tensor(name)
        scale_inv = self._handles[self._where[scales]].get_tensor(scales).float()
        return FP8Weight(values, scale_inv, self.fp8.block)

    def fp8_experts(self, layer: int) -> list[QuantizedExpert]:
        return fp8_experts(self, TensorMap.for_spec(self.spec), layer, self.dtype)

    def int4_weight(self, name: str, shape: Shape) -> PackedWeight | None:
        """The module of tensor `name` as stored, if the integer checkpoint quantized it (checked by
        `validate`)."""
        if self.int4 is None or name in self._where or not self.int4.stored(name, self.has):
            return None
        return self.int4.read(name, tuple(shape), self._stored, self.has)

    def int4_experts(self, layer: int) -> list[QuantizedExpert]:
        assert self.int4 is not None
        tensor_map = TensorMap.for_spec(self.spec)
        return int4_experts(self.int4, self._stored, self.has, tensor_map, layer, self.dtype)

    def _stored(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    # ---- validation

    def _check(self, name: str, shape: Shape) -> None:
        if name not in self._where and self.int4 is not None and self.int4.stored(name, self.has):
            self.int4.check(name, tuple(shape), self._info, self._where)
            return
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        shard, info = self._where[name], self._info[name]
        if info.shape != tuple(shape):
            raise CheckpointError(
                f"{shard}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}"
            )
        if info.dtype == FP8_DTYPE:
            self._check_fp8(name, info.shape)
        elif info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{shard}: tensor {name} has dtype {info.dtype}, expected one of F32, F16, BF16"
                + (" or F8_E4M3 with block scales" if self.fp8 is not None else "")
            )

    def _check_fp8(self, name: str, shape: Shape) -> None:
        """An F8_E4M3 tensor needs the config's fp8 quantization and its block scales."""
        shard, scales = self._where[name], scale_name(name)
        if self.fp8 is None:
            raise CheckpointError(
                f"{shard}: tensor {name} is F8_E4M3, but {self.folder / 'config.json'} has no "
                f'"quantization_config" of quant_method "fp8"'
            )
        if not self.fp8.converted(name):
            raise CheckpointError(
                f"{shard}: tensor {name} is F8_E4M3, but its module is in "
                "quantization_config.modules_to_not_convert"
            )
        if scales not in self._where:
            raise CheckpointError(
                f"{shard}: tensor {scales} (the block scales of FP8 tensor {name}) is missing"
            )
        info, want = self._info[scales], self.fp8.scale_shape(shape)
        if info.shape != want:
            raise CheckpointError(
                f"{self._where[scales]}: tensor {scales} has shape {list(info.shape)}, expected {list(want)} "
                f"(one scale per {self.fp8.block[0]}x{self.fp8.block[1]} block of {name} {list(shape)})"
            )
        if info.dtype not in SCALE_DTYPES:
            raise CheckpointError(
                f"{self._where[scales]}: tensor {scales} has dtype {info.dtype}, expected one of "
                f"{', '.join(SCALE_DTYPES)}"
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


def _drop_pages(region: mmap.mmap, offset: int, begin: int, end: int) -> None:
    """Unmap the whole pages of bytes [offset + begin, offset + end) of `region` from the process (a
    private, unwritten file mapping: a later read maps them again from the page cache)."""
    first = -(-(offset + begin) // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (offset + end) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


def _check_folder(folder: Path) -> None:
    try:
        mode = folder.stat().st_mode
    except OSError as exc:
        raise CheckpointError(f"{folder}: checkpoint folder: {os_reason(exc)}") from exc
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{folder}: not a checkpoint folder (a file)")
