"""A MoE layer's combine on the CPU in one C call (cpu_combine.c, built with the other kernels by
`native.library()`): the residual plus the routed experts' outputs added into their tokens' rows in
ascending expert order, the floats of MoEModel.routed_sum and the residual add bit for bit.

A decode step combines each layer once, right after its experts streamed their weights through
the caches, where each of torch's ~6 operations for it runs cold.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from flowmoe.kernels import native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_PP, _PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


def kernel() -> Callable[..., int] | None:
    """flowmoe_combine, or None (see native.function)."""
    return native.function("flowmoe_combine", (_L, _L, _P, _L, _I, _I, _PP, _PI, _I, _P, _P, _I), _I)


_DTYPES = (torch.float32, torch.bfloat16)


def fits(hidden: torch.Tensor, outputs: list[torch.Tensor]) -> bool:
    """Whether `combine` takes hidden [T, H] and the experts' outputs [n_e, H]: host tensors, fp32
    or bf16, rows of unit column stride (the outputs contiguous), no autograd. Asked first thing after
    a layer's experts streamed their weights through the caches, where each attribute read misses:
    `is_cpu` (no device object made), each output's dtype and width against the first's."""
    if not outputs or not hidden.is_cpu or hidden.dtype not in _DTYPES or hidden.dim() != 2:
        return False
    dtype, width = outputs[0].dtype, hidden.shape[1]
    return (
        hidden.stride(1) == 1
        and dtype in _DTYPES
        and all(
            o.is_cpu and o.dtype is dtype and o.shape[1:] == (width,) and o.is_contiguous() for o in outputs
        )
        and not (torch.is_grad_enabled() and (hidden.requires_grad or any(o.requires_grad for o in outputs)))
        and kernel() is not None
    )


def combine(hidden: torch.Tensor, rows: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    """hidden [T, H] + outputs[e] [n_e, H] added into the rows rows[...] (rows [sum n_e] int64, each
    expert's n_e in turn; experts in the order given) -> [T, H] in hidden's dtype (where `fits`)."""
    run = kernel()
    assert run is not None
    index = rows.contiguous()  # [sum n_e]
    tokens, width = hidden.shape
    out = torch.empty(tokens, width, dtype=hidden.dtype)  # [T, H]
    pointers = native.pointers([o.data_ptr() for o in outputs])
    counts = (ctypes.c_int * len(outputs))(*[o.shape[0] for o in outputs])  # not len(o): a Python call each
    bf16, values_bf16 = int(hidden.dtype == torch.bfloat16), int(outputs[0].dtype == torch.bfloat16)
    status = run(
        tokens, width, hidden.data_ptr(), hidden.stride(0), bf16, len(outputs), pointers, counts, values_bf16,
        index.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("combine: no memory for the kernel's fp32 sums")
    return out


def scaler() -> Callable[..., None] | None:
    """flowmoe_scale_rows, or None (see native.function)."""
    return native.function("flowmoe_scale_rows", (_L, _L, _P, _I, _P, _I, _P, _I))


def scale_rows(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out [n, H] = values [n, H] * scales [n, 1] (torch's product, bit for bit), in one C call: what
    follows a kernel call, where every check costs cache misses, so the caller's tensors are taken as
    they come: values and out contiguous host tensors, fp32 or bf16, out of the product's dtype. Scales
    neither fp32 nor bf16, or not contiguous, go to torch."""
    run = scaler()
    if run is None or scales.dtype not in _DTYPES or not scales.is_contiguous():
        torch.mul(values, scales.view(-1, 1), out=out)
        return
    n, width = values.shape
    bf16 = torch.bfloat16
    run(n, width, values.data_ptr(), values.dtype is bf16, scales.data_ptr(), scales.dtype is bf16,
        out.data_ptr(), out.dtype is bf16)  # fmt: skip
