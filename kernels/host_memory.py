"""Host buffers on transparent huge pages, for the weights and KV caches the CPU streams through.

A CPU expert or a decode attention reads its operand once, at the memory's speed, and with 4 KiB
pages that speed is capped by the TLB: each 4 KiB page costs a page walk, and a few-row GEMM
against an expert-sized weight touches thousands of them per call. On 2 MiB pages the same read
needs 512x fewer translations. Measured on the 2-vCPU AMX Xeon of issue 15 (a 1 GiB read, AVX-512,
2 threads): 22.6 GB/s on 4 KiB pages, 30.0 GB/s on huge pages; the grouped expert FFN of the issue's
checkpoint at 4 rows per expert 18.7 -> 22.2 GB/s (bench/RESULTS.md, "CPU kernels").

Linux gives an anonymous private mapping huge pages when it is `madvise(MADV_HUGEPAGE)`d and
/sys/kernel/mm/transparent_hugepage/enabled is `madvise` (the common default) or `always`.
Elsewhere (`never`, another OS, FLOWMOE_HUGE_PAGES=0) `huge_empty` returns ordinary memory: only
the speed differs.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
MIN_BYTES = HUGE_PAGE  # smaller buffers cannot fill a huge page: ordinary memory


def _wanted(nbytes: int) -> bool:
    return (
        nbytes >= MIN_BYTES
        and os.environ.get("FLOWMOE_HUGE_PAGES", "1") != "0"
        and hasattr(mmap, "MADV_HUGEPAGE")
        and hasattr(mmap, "MAP_PRIVATE")
    )


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised host buffer (uint8 [nbytes]) starting on a 2 MiB boundary, on huge pages where
    the OS grants them. The mapping is freed when the last tensor viewing it is."""
    if not _wanted(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: shared anonymous memory is shmem's THP policy
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    except OSError:  # a mapping refused (strict overcommit, a limit): torch's allocator says so its way
        return torch.empty(nbytes, dtype=torch.uint8)
    with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages, only slower
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _huge_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of `shape` and `dtype` on huge pages (see huge_empty)."""
    return huge_empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on huge pages (see huge_empty)."""
    return _huge_tensor(shape, dtype).zero_()


def huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor `tensor` on huge pages (see huge_empty)."""
    return _huge_tensor(tuple(tensor.shape), tensor.dtype).copy_(tensor)
