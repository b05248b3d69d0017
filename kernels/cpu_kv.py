"""A step's new keys and values into a layer's KV cache in one C call (cpu_kv.c, built with the
other kernels by `native.library()`): the bytes of kv_cache.write_rows' two indexed writes, from the
step's layout (each sequence's rows go to consecutive positions of its slot), on the CPU in any
dtype. A decode step writes each layer's cache once: torch's form is two index_put_ and two views
per layer, each costing a dispatch after the experts' weights streamed through the caches.
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.kernels import native
from flowmoe.kernels.layout import TokenLayout

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


kernel = native.Kernel(
    "flowmoe_write_kv", (_I, _P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _P, _L, _L, _L)
)  # or None


def _cache_facts(cache: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]] | None:
    """A layer's keys or values [slots, kv_heads, capacity, head_dim] as the kernel takes them: (dtype,
    shape, (address, slot, head and position strides in bytes)), or None where it does not (off the
    host, not 4-d, a last stride other than 1)."""
    if not cache.is_cpu or cache.dim() != 4 or cache.stride(3) != 1:
        return None
    size = cache.element_size()
    strides = tuple(s * size for s in cache.stride()[:3])
    return cache.dtype, tuple(cache.shape), (cache.data_ptr(), *strides)


_cache = native.Facts(_cache_facts)  # a cache's layers are checked on their first write


def write(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """k, v [T, kv_heads, head_dim] into keys / values [slots, kv_heads, capacity, head_dim] at each
    token's (slot, position) in one C call, where the kernel takes them (-> True; else False, nothing
    written): host tensors of one dtype and shape each pair, unit last strides, every position inside
    the cache, no autograd (the caches' part checked once per cache tensor)."""
    held, kept, run = _cache(keys), _cache(values), kernel()
    if held is None or kept is None or run is None:
        return False
    dtype, (slots, heads, capacity, dim) = held[0], held[1]
    if not (
        kept[0] is dtype
        and kept[1] == held[1]
        and k.is_cpu  # `is_cpu`: no device object made (asked at every layer, with the caches cold)
        and v.is_cpu
        and k.dtype is dtype
        and v.dtype is dtype
        and k.shape == v.shape == (layout.tokens, heads, dim)
        and k.stride(-1) == v.stride(-1) == 1
        and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
    ):
        return False
    # built by the step's first layer: None where some position lies outside the cache
    where = layout.derived(("kv where", slots, capacity), lambda: _where(layout, slots, capacity))
    if where is None:
        return False
    size = k.element_size()
    ks, vs = k.stride(), v.stride()
    run(
        len(layout.slots), where, heads, dim * size,
        k.data_ptr(), ks[0] * size, ks[1] * size, v.data_ptr(), vs[0] * size, vs[1] * size,
        *held[2], *kept[2],
    )  # fmt: skip
    return True


def _where(layout: TokenLayout, slots: int, capacity: int) -> ctypes.Array[ctypes.c_long] | None:
    """(first row, slot, past, count) of each sequence, as the kernel reads them (the same every layer),
    or None where some token's (slot, position) lies outside a [slots, ., capacity, .] cache."""
    inside = all(0 <= s < slots for s in layout.slots) and all(
        p >= 0 and p + c <= capacity for p, c in zip(layout.past, layout.counts, strict=True)
    )
    if not inside:
        return None
    where = [x for i, slot in enumerate(layout.slots)
             for x in (layout.starts[i], slot, layout.past[i], layout.counts[i])]  # fmt: skip
    return (ctypes.c_long * len(where))(*where)
