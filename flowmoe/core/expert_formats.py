"""Bytes of one routed expert in each expert format (Policy.expert_format): what it holds in host
memory and moves over the link. The GPU holds it dequantized, in the model's dtype, whatever the
format. flowmoe/model/quantized.py holds the layouts these count; every figure is the layout's own
arithmetic, no measurement.

An expert is gate and up [I, hidden] and down [hidden, I] (nn.Linear's [out, in]), plus its biases,
if any, kept in the model's dtype in every format.

* native: the model's dtype.
* fp8: a byte per weight and a float32 scale per 128 x 128 block (the FP8 releases' layout).
* int8: a byte per weight and a float32 scale per row (output channel): ~1.0 byte per weight.
* int4: half a byte per weight and a float16 scale and zero per group of 128 columns of a row:
  0.5 + 4 / 128 = 0.531 bytes per weight (~3.8x fewer than bfloat16).
* hqq4: int4's layout at group 64, Klotski's weight group size (klotski.txt §Compression: "4 bits,
  using a group size of 64"): 0.5 + 4 / 64 = 0.5625 bytes per weight.

A layer's attention projections (Policy.attention_format: Klotski(q) quantizes "both expert and
attention tensors") take the same layouts, q/k/v stacked [q + 2kv, hidden] and o [hidden, q], their
biases and norms in the model's dtype: `dense_layer_bytes` is what a layer's dense part (attention,
router, shared or dense MLP) holds in host memory and moves over the link when it is offloaded.
"""

from __future__ import annotations

from flowmoe.core.errors import ConfigError
from flowmoe.core.policy import QUANTIZED_ON_LOAD, AttentionFormat, ExpertFormat
from flowmoe.core.spec import ModelSpec

FP8_BLOCK = (128, 128)  # weight_block_size of the DeepSeek-V3, Kimi K2 and Qwen3-FP8 releases
INT4_GROUP = 128  # columns per scale and zero of `int4`
HQQ4_GROUP = 64  # of `hqq4`: Klotski's weight group size
INT4_GROUPS: dict[ExpertFormat, int] = {"int4": INT4_GROUP, "hqq4": HQQ4_GROUP}
# an int8 / int4 / hqq4 projection dequantizes in torch a few rows at a time (model/quantized.py,
# in_row_blocks; on a GPU with triton int4 / hqq4 take one fused kernel, no temporaries): each float32
# temporary holds at most this many values, and a block keeps at most DEQUANT_TEMPORARIES of them alive
# (the unpacked values, the scales and zeros spread over the columns, their difference)
DEQUANT_ELEMENTS = 1 << 23
DEQUANT_TEMPORARIES = 4


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _projections(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(rows, columns) of gate, up and down."""
    h, i = spec.hidden, spec.moe.intermediate
    return (i, h), (i, h), (h, i)


def _biases(spec: ModelSpec) -> int:
    """Bytes of an expert's biases, if any, in the model's dtype."""
    return (spec.expert_params - 3 * spec.hidden * spec.moe.intermediate) * spec.dtype_bytes


def fp8_expert_bytes(spec: ModelSpec, block: tuple[int, int] = FP8_BLOCK) -> int:
    """One routed expert as an FP8 checkpoint stores it: a byte per weight of its three projections,
    a float32 scale per block of each (the edge blocks partial), and its biases."""
    scales = sum(_ceil(r, block[0]) * _ceil(c, block[1]) for r, c in _projections(spec))
    return 3 * spec.hidden * spec.moe.intermediate + 4 * scales + _biases(spec)


def packed_weight_bytes(rows: int, cols: int, form: ExpertFormat, dtype_bytes: int) -> int:
    """A [rows, cols] projection's bytes in `form` (not fp8: `fp8_expert_bytes`)."""
    if form == "native":
        return rows * cols * dtype_bytes
    if form == "int8":  # int8 values, a float32 scale per row
        return rows * cols + 4 * rows
    group = INT4_GROUPS[form]  # two values per byte, a float16 scale and zero per group
    return rows * _ceil(cols, 2) + 4 * rows * _ceil(cols, group)


def packed_expert_bytes(spec: ModelSpec, expert_format: ExpertFormat) -> int:
    """One routed expert's bytes in host memory and on the link in `expert_format`."""
    if expert_format == "native":
        return spec.expert_bytes
    if expert_format == "fp8":
        return fp8_expert_bytes(spec)
    weights = sum(packed_weight_bytes(r, c, expert_format, spec.dtype_bytes) for r, c in _projections(spec))
    return weights + _biases(spec)


def attention_projections(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(rows, columns) of the stacked q/k/v and of o: the tensors an attention format quantizes."""
    a = spec.attention
    if a.mla is not None:
        raise ConfigError(
            f"--attention-format quantizes the q/k/v and o projections of grouped-query attention; "
            f"{spec.name} uses multi-head latent attention: leave --attention-format out (native)"
        )
    return (a.q_width + 2 * a.kv_width, spec.hidden), (spec.hidden, a.out_width)


def attention_bytes(spec: ModelSpec, attention_format: AttentionFormat) -> int:
    """Bytes of one layer's q/k/v and o projections in `attention_format`."""
    b = spec.dtype_bytes
    return sum(packed_weight_bytes(r, c, attention_format, b) for r, c in attention_projections(spec))


def dense_layer_bytes(spec: ModelSpec, layer: int, attention_format: AttentionFormat) -> int:
    """A layer's dense part (attention, router, shared or dense MLP) in host memory and on the link,
    its attention projections in `attention_format`."""
    native = spec.layer_dense_bytes(layer)
    if attention_format == "native":
        return native
    return native - attention_bytes(spec, "native") + attention_bytes(spec, attention_format)


def dequant_working_bytes(spec: ModelSpec, expert_format: ExpertFormat) -> int:
    """GPU bytes an expert's dequantization (at its first use after its copy: one expert at a time, on
    the compute stream) holds beyond the dequantized expert the weight buffers count: its packed copy
    and the float32 temporaries of one row block of the torch path (the int4 / hqq4 Triton kernel has
    none: the bound holds either way), for the formats quantized on load (int8, int4, hqq4); 0 for
    native. (fp8 and the GPTQ / AWQ / compressed-tensors
    layouts still dequantize a whole projection at once: not counted here.)"""
    if expert_format not in QUANTIZED_ON_LOAD:
        return 0
    return packed_expert_bytes(spec, expert_format) + DEQUANT_TEMPORARIES * DEQUANT_ELEMENTS * 4
