"""A safetensors shard's header, read and checked against the file before any tensor is mapped.

The format: an 8-byte little-endian header length, a JSON header of
`{name: {"dtype", "shape", "data_offsets": [begin, end]}}`, then the data.
Reading it ourselves bounds what a garbage file can make us allocate and lets a
truncated or inconsistent shard fail with one line naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from attrs import frozen

from flowmoe.core.bounded_read import open_regular
from flowmoe.core.errors import CheckpointError
from flowmoe.core.os_errors import os_reason

MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@frozen
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # bytes from the start of the file to the tensor's first byte
    nbytes: int = 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the shard, after checking that its bytes lie inside the file."""
    try:
        with open_regular(path, CheckpointError) as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little") if size >= 8 else -1
            if length < 0:
                raise CheckpointError(
                    f"{path}: not a safetensors file ({size} bytes, shorter than its header)"
                )
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: not a safetensors file (header length {length} bytes, over the "
                    f"{MAX_HEADER_BYTES // 10**6} MB limit)"
                )
            if 8 + length > size:
                raise CheckpointError(
                    f"{path}: truncated safetensors file (header of {length} bytes, file of {size})"
                )
            raw = file.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: {os_reason(exc)}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, an integer of too many digits
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data_bytes = size - 8 - length
    return {
        name: _tensor(path, name, entry, data_bytes, 8 + length)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor(path: Path, name: str, entry: Any, data_bytes: int, data_start: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = (
            isinstance(dtype, str)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(begin) is int
            and type(end) is int
            and 0 <= begin <= end
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name} has a malformed header entry") from exc
    if not valid:
        raise CheckpointError(f"{path}: tensor {name} has a malformed header entry")
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: tensor {name} ends at data byte {end}, past the end of the file "
            f"({data_bytes} data bytes; truncated?)"
        )
    if dtype in DTYPE_BYTES and math.prod(shape) * DTYPE_BYTES[dtype] != end - begin:
        raise CheckpointError(
            f"{path}: tensor {name} holds {end - begin} bytes, but {dtype} {list(shape)} needs "
            f"{math.prod(shape) * DTYPE_BYTES[dtype]}"
        )
    return TensorInfo(dtype, tuple(shape), data_start + begin, end - begin)
