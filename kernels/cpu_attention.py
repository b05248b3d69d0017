"""Decode attention on the CPU at memory speed: cpu_attention.c, built on first use.

A decode step gives each sequence one query, so its attention is a read of the sequence's cached
keys and values with a little arithmetic per byte. cpu_attention.c reads each KV head's keys and
values once for the g query heads that share it, splits long caches into chunks that the threads
share (flash-decoding), and merges them in a fixed order: a sequence gets the same result in any
batch and with any thread count. Windows and chunked attention need no mask here (a single query
sees one contiguous range of keys); sinks enter the softmax's denominator in the kernel.
Numbers: bench/RESULTS.md (issue 15).

The kernel is chosen by the CPU's features at run time (`isa`): cpu_attention.c's ("avx512", built
for AVX-512 hosts only) where the library has it, else cpu_attention_avx2.c's ("avx2") on a CPU with
AVX2 and FMA; FLOWMOE_CPU_ISA names one where the CPU runs it (=portable: no AVX2 intrinsics, the
AVX-512 one). On a Zen 4 (1 thread, a b1 decode call per layer over 8 layers' caches, 32 query
heads on 8 KV heads, 15-25 alternated rounds, load 3.6-4) the AVX-512 kernel against the AVX2 one
at 128 / 256 / 512 keys: bf16 head dim 32 1.14x / 1.23x / 1.20x, 128 1.17x / 1.27x / 1.52x; fp32
head dim 32 0.99x / 0.97x / 0.96x, 128 1.03x / 1.38x / 1.44x.
Without the library (no compiler, a non-x86 host, FLOWMOE_CPU_KERNELS=0), on a host with neither,
or for other dtypes and head sizes, kernels/attention.py takes torch's path instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch

from flowmoe.kernels import native

CHUNK = 512  # keys per work item: 128-256 KiB of K (and as much V) at head dim 128
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


KERNELS = {"avx2": "flowmoe_decode_attention_avx2", "avx512": "flowmoe_decode_attention"}  # by isa
NEEDS = {"avx2": frozenset({"avx2", "fma"}), "avx512": frozenset()}  # avx512: where the library has it
DEFAULT = ("avx512", "avx2")  # the first of these the CPU runs is the default
FORCED = {"portable": "avx512"}  # FLOWMOE_CPU_ISA's other names: the kernel each takes


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with this module's functions declared (those of `KERNELS` the library
    has: cpu_attention.c's on AVX-512 hosts only), or None (see native.library)."""
    lib = native.library()
    if lib is None:
        return None
    for name in KERNELS.values():
        if hasattr(lib, name):
            kernel = getattr(lib, name)
            kernel.argtypes = [_I, _P, _I, _I, _I, _I, _P, _L, _L]
            kernel.argtypes += [_P, _L, _L, _L, _P, _L, _L, _L]  # keys, values: data, strides
            kernel.argtypes += [_P, _F, _I, _P, _L, _I]
            kernel.restype = _I
    return lib


def kernel() -> Callable[..., int] | None:
    """This CPU's decode attention kernel (see the module's notes), or None where there is none."""
    name = isa()
    return None if name is None else getattr(library(), KERNELS[name])


@functools.cache
def isa() -> str | None:
    """The kernel this CPU runs (a key of KERNELS): the one FLOWMOE_CPU_ISA names (or FORCED maps it
    to) where the CPU runs it, else the first of DEFAULT; None where it runs neither. Worked out at the
    first call (it is asked twice a layer, and an unset variable costs a KeyError raised and caught in
    os.environ.get: ~75 us a decode step, issue 25): `isa.cache_clear()` after changing FLOWMOE_CPU_ISA."""
    wanted = os.environ.get("FLOWMOE_CPU_ISA", "")
    return native.chosen_block(FORCED.get(wanted, wanted), _built(library()), DEFAULT)


def kernels() -> tuple[str, ...]:
    """The kernels (keys of KERNELS) this host's library has and its CPU runs."""
    flags = native.cpu_flags()
    return tuple(n for n, needs in _built(library()).items() if needs <= flags)


@functools.cache
def _built(lib: ctypes.CDLL | None) -> dict[str, frozenset[str]]:
    """NEEDS of the kernels `lib` has."""
    return {n: NEEDS[n] for n in KERNELS if lib is not None and hasattr(lib, KERNELS[n])}


def fits(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `decode` takes q [T, H, D] against keys / values [slots, kv_heads, C, D]: host
    tensors of one dtype, fp32 (D a multiple of 16) or bf16 (of 32), contiguous last dimensions, no
    autograd. Asked at every layer of a decode step, after the experts have streamed their weights
    through the caches: few calls (each costs cache misses there)."""
    dtype, dim = q.dtype, q.shape[-1]
    return (
        (dtype is torch.float32 or dtype is torch.bfloat16)
        and keys.dtype is dtype
        and values.dtype is dtype
        and dim % (32 if dtype is torch.bfloat16 else 16) == 0
        and keys.shape[-1] == dim
        and values.shape == keys.shape
        and q.is_cpu
        and keys.is_cpu
        and values.is_cpu
        and keys.stride(-1) == 1
        and values.stride(-1) == 1
        and q.shape[1] % keys.shape[1] == 0
        and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))
        and kernel() is not None
    )


def decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sequences: list[tuple[int, int, int, int]],
    out: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
    chunk: int = CHUNK,
) -> None:
    """Where `fits`: sequences[i] = (row, slot, lo, hi): q[row] [H, D] attends to keys / values
    [slot, :, lo:hi] -> out[row] [H * D] (out: [T, H * D], contiguous, q's dtype); sinks [H] or None."""
    run = kernel()
    assert run is not None
    rows, slots, capacity = q.shape[0], keys.shape[0], keys.shape[2]
    if not all(0 <= r < rows and 0 <= s < slots and 0 <= lo < hi <= capacity for r, s, lo, hi in sequences):
        raise IndexError(f"decode attention: sequences {sequences} outside q {q.shape} / cache {keys.shape}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    flat = [x for seq in sequences for x in seq]
    sink = sinks.float().contiguous() if sinks is not None else None
    status = run(
        len(sequences),
        (ctypes.c_int * len(flat))(*flat),
        q.shape[1],
        keys.shape[1],
        q.shape[2],
        int(q.dtype == torch.bfloat16),
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        keys.data_ptr(),
        *keys.stride()[:3],
        values.data_ptr(),
        *values.stride()[:3],
        sink.data_ptr() if sink is not None else None,
        scale,
        chunk,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention: no memory for the per-chunk partial results")
