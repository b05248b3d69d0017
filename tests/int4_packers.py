"""Test checkpoints in the layouts GPTQ, AWQ and compressed-tensors write, made by our own packer from
the formats' specifications (docs/quantized-checkpoints.md), not by the quantizers (not installable
here) nor by flowmoe's loader. Round to nearest, group by group: the values are a quantization of
the weights; the layouts are what is under test.

`write_quantized` turns a `save_pretrained` folder into such a checkpoint: every 2-D weight of a
decoder layer but the router is quantized (as the published MoE checkpoints do), the rest kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's WQLinear_GEMM.from_linear: word slot i <- column


def _pack_words(levels: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned levels -> int32 words of 32 / bits levels along `axis`, the first in the low bits
    (AutoGPTQ's QuantLinear.pack, compressed-tensors' pack_to_int32); a ragged end padded with 0."""
    per_word = 32 // bits
    moved = np.moveaxis(levels.astype(np.uint64), axis, -1)
    pad = -moved.shape[-1] % per_word
    moved = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad), np.uint64)], axis=-1)
    words = np.zeros((*moved.shape[:-1], moved.shape[-1] // per_word), np.uint64)
    for slot in range(per_word):
        words |= moved[..., slot::per_word] << np.uint64(bits * slot)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def rtn(
    weight: np.ndarray, bits: int, group_of: np.ndarray, groups: int, symmetric: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [R, C] float32 -> (levels [R, C], zeros [R, G], scales [R, G] float16): each row's
    group of columns over 2^bits levels, rounded to nearest with the float16 scale."""
    top = (1 << bits) - 1
    rows = weight.shape[0]
    zeros, scales = np.zeros((rows, groups), np.int64), np.ones((rows, groups), np.float16)
    for g in range(groups):
        part = weight[:, group_of == g]
        if symmetric:
            scale = np.abs(part).max(axis=1) / (top // 2)
            zero = np.full(rows, (top + 1) // 2)
        else:
            low, high = np.minimum(part.min(axis=1), 0), np.maximum(part.max(axis=1), 0)
            scale = (high - low) / top
            zero = np.clip(np.round(-low / np.maximum(scale, 1e-8)), 0, top)
        scales[:, g] = np.maximum(scale, 1e-4).astype(np.float16)
        zeros[:, g] = zero
    wide_scale = scales.astype(np.float32)[:, group_of]
    levels = np.clip(np.round(weight / wide_scale) + zeros[:, group_of], 0, top).astype(np.int64)
    return levels, zeros, scales


def gptq(
    weight: np.ndarray, bits: int, group: int, act_order: bool, symmetric: bool, v1: bool, seed: int
) -> dict[str, np.ndarray]:
    """AutoGPTQ's QuantLinear buffers (qlinear_cuda_old.py / qlinear_cuda.py `pack`): qweight
    [C / f, R] packed along the input, qzeros [G, R / f] along the output (v1: zero - 1, wrapped to
    the bit width), scales [G, R], g_idx [C] (act-order: the groups follow a column permutation)."""
    cols = weight.shape[1]
    size = cols if group == -1 else group
    groups = -(-cols // size)
    order = np.random.default_rng(seed).permutation(cols) if act_order else np.arange(cols)
    g_idx = np.empty(cols, np.int32)
    g_idx[order] = np.arange(cols) // size  # act-order: the i-th column quantized is in group i // size
    levels, zeros, scales = rtn(weight, bits, g_idx, groups, symmetric)
    stored_zeros = (zeros - 1) % (1 << bits) if v1 else zeros
    return {
        "qweight": _pack_words(levels.T, bits, 0),
        "qzeros": _pack_words(stored_zeros.T, bits, 1),
        "scales": scales.T.copy(),
        "g_idx": g_idx,
    }


def awq(weight: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """AutoAWQ's WQLinear_GEMM buffers (awq/modules/linear/gemm.py `from_linear`): qweight
    [C, R / 8] and qzeros [C / group, R / 8] packed along the output, word slot i holding column
    AWQ_PACK_ORDER[i] of its eight; scales [C / group, R]."""
    cols = weight.shape[1]
    levels, zeros, scales = rtn(weight, 4, np.arange(cols) // group, cols // group, False)

    def pack(values: np.ndarray) -> np.ndarray:  # [N, 8 k] columns -> [N, k] words
        words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint64)
        for slot, column in enumerate(AWQ_PACK_ORDER):
            words |= values[:, column::8].astype(np.uint64) << np.uint64(4 * slot)
        return words.astype(np.uint32).view(np.int32)

    return {"qweight": pack(levels.T), "qzeros": pack(zeros.T), "scales": scales.T.copy()}


def pack_quantized(
    weight: np.ndarray, bits: int, group: int, symmetric: bool, act_order: bool, seed: int
) -> dict[str, np.ndarray]:
    """compressed-tensors' PackedQuantizationCompressor (pack_quantized.py `compress_weight`):
    weight_packed [R, ceil(C / f)] packed along the input, signed values stored + 2^(bits - 1);
    weight_scale [R, G]; asymmetric: weight_zero_point [ceil(R / f), G] packed along the output,
    offset alike; weight_shape [2]; actorder "group": weight_g_idx [C]."""
    rows, cols = weight.shape
    size = cols if group == -1 else group
    if act_order:
        g_idx = np.empty(cols, np.int32)
        g_idx[np.random.default_rng(seed).permutation(cols)] = np.arange(cols) // size
    else:
        g_idx = (np.arange(cols) // size).astype(np.int32)
    levels, zeros, scales = rtn(weight, bits, g_idx, -(-cols // size), symmetric)
    out = {
        "weight_packed": _pack_words(levels, bits, 1),
        "weight_scale": scales,
        "weight_shape": np.array([rows, cols], np.int32),
    }
    if not symmetric:
        out["weight_zero_point"] = _pack_words(zeros, bits, 0)
    if act_order:
        out["weight_g_idx"] = g_idx
    return out


def quantized_module(name: str, tensor: torch.Tensor) -> bool:
    """What the quantizers convert: a decoder layer's 2-D weights, not the router."""
    routers = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
    return tensor.ndim == 2 and name.startswith("model.layers.") and not name.endswith(routers)


def write_quantized(plain: Path, folder: Path, quant: dict[str, Any], pack) -> Path:
    """`plain` (a save_pretrained folder) as a checkpoint whose quantized modules hold what
    `pack(weight [R, C] float32 numpy, seed)` returns, under `quantization_config` `quant`."""
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open)
    out: dict[str, torch.Tensor] = {}
    for seed, (name, tensor) in enumerate(sorted(state.items())):
        if not quantized_module(name, tensor):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        for suffix, value in pack(tensor.float().numpy(), seed).items():
            out[f"{module}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(value))
    folder.mkdir(parents=True)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return folder
