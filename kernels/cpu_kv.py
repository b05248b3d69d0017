"""A step's new keys and values into a layer's KV cache in one C call (cpu_kv.c, built with the
other kernels by `native.library()`): the bytes of kv_cache.write_rows' two indexed writes, from the
step's layout (each sequence's rows go to consecutive positions of its slot), on the CPU in any
dtype. A decode step writes each layer's cache once: torch's form is two index_put_ and two views
per layer, each costing a dispatch after the experts' weights streamed through the caches.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from flowmoe.kernels import native
from flowmoe.kernels.layout import TokenLayout

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def kernel() -> Callable[..., None] | None:
    """flowmoe_write_kv, or None (see native.function)."""
    return native.function(
        "flowmoe_write_kv", (_I, _P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _P, _L, _L, _L)
    )


def fits(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether `write` takes k, v [T, kv_heads, head_dim] into keys / values [slots, kv_heads, capacity,
    head_dim] at the layout's (slot, position)s: host tensors of one dtype and shape each pair, unit
    last strides, every position inside the cache, no autograd."""
    slots, _, capacity, dim = keys.shape
    return (
        keys.is_cpu  # `is_cpu`: no device object made (asked at every layer, with the caches cold)
        and values.is_cpu
        and k.is_cpu
        and v.is_cpu
        and keys.dtype == values.dtype == k.dtype == v.dtype
        and values.shape == keys.shape
        and k.shape == v.shape == (layout.tokens, keys.shape[1], dim)
        and keys.stride(-1) == values.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and layout.derived(("kv inside", slots, capacity), lambda: _inside(layout, slots, capacity))
        and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
        and kernel() is not None
    )


def write(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v [T, kv_heads, head_dim] into keys / values [slots, kv_heads, capacity, head_dim] at each
    token's (slot, position) (where `fits`)."""
    run = kernel()
    assert run is not None
    size = k.element_size()
    where = layout.derived("kv where", lambda: _where(layout))  # built by the step's first layer
    ks, vs = keys.stride(), values.stride()
    run(
        len(layout.slots), where, keys.shape[1], keys.shape[3] * size,
        k.data_ptr(), k.stride(0) * size, k.stride(1) * size,
        v.data_ptr(), v.stride(0) * size, v.stride(1) * size,
        keys.data_ptr(), ks[0] * size, ks[1] * size, ks[2] * size,
        values.data_ptr(), vs[0] * size, vs[1] * size, vs[2] * size,
    )  # fmt: skip


def _inside(layout: TokenLayout, slots: int, capacity: int) -> bool:
    """Whether every token's (slot, position) of the layout lies inside a [slots, ., capacity, .] cache."""
    return all(0 <= s < slots for s in layout.slots) and all(
        p >= 0 and p + c <= capacity for p, c in zip(layout.past, layout.counts, strict=True)
    )


def _where(layout: TokenLayout) -> ctypes.Array[ctypes.c_long]:
    """(first row, slot, past, count) of each sequence, as the kernel reads them (the same every layer)."""
    where = [x for i, slot in enumerate(layout.slots)
             for x in (layout.starts[i], slot, layout.past[i], layout.counts[i])]  # fmt: skip
    return (ctypes.c_long * len(where))(*where)
