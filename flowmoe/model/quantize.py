"""Quantize-on-load: a routed expert in the model's dtype -> a `QuantizedExpert` of expert format
int8, int4 or hqq4 (the layouts: model/quantized.py; their bytes: core/expert_formats.py). Each
projection ([out, in]) is quantized row by row, so gate and up are quantized as the one gate_up
matrix, with the same values as one by one.

* int8: per output channel, symmetric: scale = max |w| of the row / 127, q = round(w / scale).
* int4: per group of 128 columns of a row, asymmetric, round to nearest: scale = (max - min) / 15,
  zero = -min / scale, q = clamp(round(w / scale + zero), 0, 15); scale and zero kept as float16,
  q computed with the float16 values, so that (q - zero) x scale is the dequantization.
* hqq4: int4's min-max scale at group 64, with the zero of each group chosen by Half-Quadratic
  Quantization (Badri & Shaji, "Half-Quadratic Quantization of Large Machine Learning Models", 2023;
  the reference code is mobiusml/hqq, hqq/core/optimize.py, `optimize_weights_proximal`): minimise
  the l_p norm (p = 0.7) of w - dequantize(quantize(w)) by alternating a generalised soft-threshold
  of the error (its proximal step, at a penalty beta that grows by kappa each iteration) with the
  zero's closed-form update (the mean over the group), from beta 10, kappa 1.01, for at most 20
  iterations, stopping once the mean |error| stops decreasing: HQQ's own constants. This is our own
  implementation; it keeps the zero of the lowest error (HQQ's returns the last one), and it stores
  scale and zero as float16 without HQQ's optional 8-bit quantization of them ("a zero scale group
  size of 128" in Klotski's setting).

`quantize_lm_head` does the same to the LM head (`--lm-head-format`): kept packed for the CPU
(`ModelWeights.lm_head_packed`), the dense head overwritten with its dequantization.

`quantize_layer_attention` gives a layer's attention projections (q/k/v stacked, and o) the same formats
(Klotski(q): "quantize both expert and attention tensors to 4 bits"). The layer keeps them packed
(`LayerWeights.attention_packed`), and the CPU computes them from the packed bytes (model/quantized.py,
`packed_linear`: its activations quantized to int8 per block of 32, as the packed experts' are, so its
outputs differ from the dequantized weights' by design); `attn` holds the values they dequantize to,
in the model's dtype, for the GPU: they cross the link so (the cost model prices the packed bytes:
core/expert_formats.py, `dense_layer_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from attrs import evolve

from flowmoe.core.expert_formats import INT4_GROUPS, attention_projections
from flowmoe.core.policy import AttentionFormat, ExpertFormat
from flowmoe.model.quantized import (
    Int4Weight,
    Int8Weight,
    PackedWeight,
    QuantizedExpert,
    pack_int4,
    stacked_rows,
)
from flowmoe.model.weights import FFNWeights, LayerWeights, ModelWeights

if TYPE_CHECKING:
    from flowmoe.core.spec import ModelSpec

INT4_MAX = 15
INT8_MAX = 127
SMALLEST_SCALE = 2.0**-24  # float16's smallest positive value: a constant group still has a scale
# HQQ's solver (mobiusml/hqq, hqq/core/optimize.py, the opt_params defaults)
HQQ_LP_NORM = 0.7
HQQ_BETA = 10.0
HQQ_KAPPA = 1.01
HQQ_ITERS = 20
BLOCK_WEIGHTS = 1 << 22  # weights int8 and int4 quantize at a time (whole rows): 16 MiB a float32 temporary

GroupFit = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # [R, G, g] -> scale, zero [R, G]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [R, C] -> int8 values [R, C] and a float32 scale per row [R, 1]."""
    w = weight.float()  # [R, C]
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(SMALLEST_SCALE)  # [R, 1]
    return Int8Weight(torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale)


def min_max(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [R, G, g] -> (scale, zero) [R, G] each: the group's range over 16 levels."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [R, G]
    scale = ((high - low) / INT4_MAX).clamp_min(SMALLEST_SCALE)
    return scale, -low / scale


def hqq(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [R, G, g] -> (scale, zero) [R, G]: min-max's scale, HQQ's zero (module docstring)."""
    scale, zero = min_max(groups)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)  # [R, G, 1]
    beta, best, best_zero = HQQ_BETA, float("inf"), z
    for _ in range(HQQ_ITERS):
        q = torch.round(groups / s + z).clamp(0, INT4_MAX)  # [R, G, g]
        error = groups - (q - z) * s
        current = float(error.abs().mean())
        if current >= best:
            break
        best, best_zero = current, z
        magnitude = error.abs()  # the l_p proximal step: shrink |e| by |e|^(p - 1) / beta
        shrunk = torch.sign(error) * torch.relu(magnitude - magnitude.pow(HQQ_LP_NORM - 1) / beta)
        z = (q - (groups - shrunk) / s).mean(dim=-1, keepdim=True)
        beta *= HQQ_KAPPA
    return scale, best_zero.squeeze(-1)


def quantize_int4(weight: torch.Tensor, group: int, fit: GroupFit = min_max) -> Int4Weight:
    """weight [R, C] -> int4 values two per byte, a float16 scale and zero per `group` columns of a
    row (the last group partial), chosen by `fit`."""
    w = weight.float()  # [R, C]
    rows, cols = w.shape
    full = cols // group * group
    parts = [fit(w[:, :full].reshape(rows, -1, group))] if full else []  # [R, C // group, group]
    if cols > full:
        parts.append(fit(w[:, full:].reshape(rows, 1, cols - full)))  # the partial group
    scale = torch.cat([p[0] for p in parts], dim=1).clamp_min(SMALLEST_SCALE).half()  # [R, G]
    zero = torch.cat([p[1] for p in parts], dim=1).half()  # [R, G]
    wide_scale = scale.float().repeat_interleave(group, dim=1)[:, :cols]  # [R, C]
    wide_zero = zero.float().repeat_interleave(group, dim=1)[:, :cols]  # [R, C]
    q = torch.round(w / wide_scale + wide_zero).clamp(0, INT4_MAX)  # [R, C]
    return Int4Weight(pack_int4(q), scale, zero, group, cols)


def quantize_weight(weight: torch.Tensor, expert_format: ExpertFormat) -> PackedWeight:
    """One projection [R, C] in `expert_format` (int8, int4 or hqq4). int8 and int4 quantize each row
    on its own, so they go a block of rows at a time: the same values, with float32 temporaries of a
    block (`BLOCK_WEIGHTS`) rather than of the projection; hqq4 stops on the whole projection's mean
    error, so it goes whole."""
    if expert_format == "hqq4":
        return quantize_int4(weight, INT4_GROUPS[expert_format], hqq)
    step = max(1, BLOCK_WEIGHTS // weight.shape[1])  # rows a block
    blocks = [_row_wise(weight[r : r + step], expert_format) for r in range(0, weight.shape[0], step)]
    return blocks[0] if len(blocks) == 1 else stacked_rows(blocks)


def _row_wise(weight: torch.Tensor, expert_format: ExpertFormat) -> PackedWeight:
    """Rows [R, C] in int8 or int4."""
    return (
        quantize_int8(weight)
        if expert_format == "int8"
        else quantize_int4(weight, INT4_GROUPS[expert_format])
    )


def quantize_expert(ffn: FFNWeights, expert_format: ExpertFormat, device: torch.device) -> QuantizedExpert:
    """A routed expert quantized to `expert_format`, computed on `device` (HQQ's iterations are
    elementwise passes over the weights: a GPU runs them as HQQ's reference does), kept where `ffn`
    is; its biases kept as they are."""
    home = ffn.gate_up.device
    gate_up = quantize_weight(ffn.gate_up.to(device), expert_format)
    down = quantize_weight(ffn.down.to(device), expert_format)
    packed = QuantizedExpert((gate_up,), down, ffn.gate_up.dtype).mapped(lambda t: t.to(home))  # synchronous
    return evolve(packed, gate_up_bias=ffn.gate_up_bias, down_bias=ffn.down_bias)


def quantize_layer_attention(
    spec: ModelSpec, lw: LayerWeights, attention_format: AttentionFormat, device: torch.device
) -> None:
    """A layer's q/k/v [q + 2kv, hidden] and o [hidden, q] quantized to `attention_format` (computed on
    `device`): kept packed where the layer is (`lw.attention_packed`), and overwritten in place with
    their dequantization to the model's dtype; biases and norms kept. Grouped-query attention only
    (`attention_projections` refuses MLA)."""
    kept: list[PackedWeight] = []
    for name, shape in zip(("qkv", "o"), attention_projections(spec), strict=True):
        weight = getattr(lw.attn, name)  # [R, C] in the model's dtype, a view of the layer's arena
        assert tuple(weight.shape) == shape, f"{name} is {tuple(weight.shape)}, the spec says {shape}"
        kept.append(_quantized_in_place(weight, attention_format, device))
    lw.attention_packed = (kept[0], kept[1])


def quantize_lm_head(
    spec: ModelSpec, weights: ModelWeights, lm_head_format: AttentionFormat, device: torch.device
) -> None:
    """The LM head's [vocab, hidden] quantized to `lm_head_format` (computed on `device`): kept packed
    where the head is (`weights.lm_head_packed`), and overwritten in place with its dequantization to
    the model's dtype; a bias column kept. The head must not be the embedding (loading.py refuses a
    tied one)."""
    head = weights.lm_head[:, :-1] if spec.lm_head_bias else weights.lm_head  # [vocab, hidden], a view
    weights.lm_head_packed = _quantized_in_place(head, lm_head_format, device)


def _quantized_in_place(weight: torch.Tensor, form: AttentionFormat, device: torch.device) -> PackedWeight:
    """weight [R, C] quantized to `form` (computed on `device`) and overwritten with its dequantization
    in its own dtype -> the packed form, its tensors where `weight` is."""
    packed = quantize_weight(weight.to(device), form)
    weight.copy_(packed.dequantize(weight.dtype))  # [R, C]
    return packed.rebuilt(iter([t.to(weight.device) for t in packed.tensors()]))
