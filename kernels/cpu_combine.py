"""A MoE layer's combine on the CPU in one C call (cpu_combine.c, built with the other kernels by
`native.library()`): the residual plus the routed experts' outputs added into their tokens' rows in
ascending expert order, the floats of MoEModel.routed_sum and the residual add bit for bit.

A decode step combines each layer once, right after its experts streamed their weights through
the caches, where each of torch's ~6 operations for it runs cold.
"""

from __future__ import annotations

import ctypes

import torch

from flowmoe.kernels import native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_PP, _PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


kernel = native.Kernel("flowmoe_combine", (_L, _L, _P, _L, _I, _I, _PP, _PI, _I, _P, _P, _I), _I)  # or None


_DTYPES = (torch.float32, torch.bfloat16)


def combine(hidden: torch.Tensor, rows: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor | None:
    """hidden [T, H] + outputs[e] [n_e, H] added into the rows rows[...] (rows [sum n_e] int64, each
    expert's n_e in turn; experts in the order given) -> [T, H] in hidden's dtype, in one C call; None
    where the kernel does not take them (torch's path then): host tensors, fp32 or bf16, rows of unit
    column stride (the outputs contiguous, of one dtype), no autograd. Asked first thing after a
    layer's experts streamed their weights through the caches, where each attribute read misses:
    `is_cpu` (no device object made), each output's dtype and width against the first's."""
    run = kernel()
    if run is None or not outputs or not hidden.is_cpu or hidden.dim() != 2 or hidden.stride(1) != 1:
        return None
    dtype, values = hidden.dtype, outputs[0].dtype
    if dtype not in _DTYPES or values not in _DTYPES:
        return None
    tokens, width = hidden.shape
    grad = torch.is_grad_enabled()
    if grad and hidden.requires_grad:
        return None
    pointers, counts = [], []  # not len(o): a Python call each
    for o in outputs:
        if not (
            o.is_cpu and o.dtype is values and o.dim() == 2 and o.shape[1] == width and o.is_contiguous()
        ) or (grad and o.requires_grad):
            return None
        pointers.append(o.data_ptr())
        counts.append(o.shape[0])
    index = rows.contiguous()  # [sum n_e]
    out = torch.empty(tokens, width, dtype=dtype)  # [T, H]
    bf16, values_bf16 = int(dtype is torch.bfloat16), int(values is torch.bfloat16)
    experts = len(counts)
    addresses, sizes = (ctypes.c_void_p * experts)(*pointers), (ctypes.c_int * experts)(*counts)
    status = run(
        tokens, width, hidden.data_ptr(), hidden.stride(0), bf16, experts, addresses, sizes, values_bf16,
        index.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("combine: no memory for the kernel's fp32 sums")
    return out


scaler = native.Kernel("flowmoe_scale_rows", (_L, _L, _P, _I, _P, _I, _P, _I))  # or None


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
