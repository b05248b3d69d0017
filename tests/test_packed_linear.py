"""kernels.cpu_packed.linear: one projection from int8 / int4 weights as packed (an attention
projection under --attention-format) computes what the same quantized activations times the
dequantized weights do, gives a row the same bits whatever the rows, threads and block beside it,
and is what MoEModel runs for a layer's packed q/k/v and o on the CPU, whichever copy of the layer
it is handed."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve

from flowmoe.kernels import cpu_packed
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.quantize import quantize_weight
from flowmoe.model.quantized import Int4Weight, Int8Weight, PackedWeight, packed_linear, unpack_int4
from tests.hf_models import hf_model, save_hf
from tests.test_cpu_experts import _threads
from tests.test_cpu_packed import FORMATS, ISAS, QUANTIZATION_HEADROOM, TOLERANCE, _block_max, _levels

pytestmark = pytest.mark.skipif(cpu_packed.linear_kernel() is None, reason="no C compiler here")


def _weight(form: str, rows: int, cols: int, seed: int) -> PackedWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(rows, cols, generator=generator) * cols**-0.5, form)  # type: ignore[arg-type]


def _magnitudes(weight: PackedWeight) -> torch.Tensor:
    """[R, C] float64: the size of each weight's terms in the kernel's sums: |w| for int8; int4 sums
    q and zero apart, (|q| + |zero|) x scale (tests/test_cpu_packed.py's level spread)."""
    if isinstance(weight, Int8Weight):
        return weight.dequantize(torch.float64).abs()
    assert isinstance(weight, Int4Weight)
    cols = weight.columns
    q = unpack_int4(weight.packed, cols).double()  # [R, C]
    scale = weight.scale.double().repeat_interleave(weight.group, dim=1)[:, :cols]  # [R, C]
    zero = weight.zero.double().repeat_interleave(weight.group, dim=1)[:, :cols]  # [R, C]
    return (q + zero.abs()) * scale


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FLOWMOE_CPU_ISA", request.param)
    return str(request.param)


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(37, 256), (10, 300), (6, 64)])
def test_matches_the_quantized_activations_in_float64_and_dequantize_then_multiply(
    isa: str, form: str, rows: int, cols: int
) -> None:
    """x [n, C] (n across the kernel's 32-row chunks) against the kernel's own quantization of x in
    float64 to TOLERANCE of the first-order fp32 bound, and against the unquantized x to the bound
    of each value moved by at most half its block's scale; columns with a tail past the last
    superblock, a short last block of weight rows, a bias."""
    weight = _weight(form, rows, cols, rows)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1))  # [R]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(cols))  # [n, C]
    out = packed_linear(x, weight, bias)
    assert out is not None and out.shape == (40, rows) and out.dtype == torch.float32
    levels, d = _levels(x)  # [n, C] each, float64
    dense = weight.dequantize(torch.float64)  # [R, C]
    exact = levels @ dense.T + bias.double()  # [n, R]
    rounding = levels.abs() @ _magnitudes(weight).T + bias.double().abs()  # [n, R]
    assert bool(((out.double() - exact).abs() <= TOLERANCE * rounding).all())
    moved = (d / 2) @ dense.abs().T  # [n, R]: each activation off by at most d / 2
    plain = x.double() @ dense.T + bias.double()
    assert bool(((out.double() - plain).abs() <= QUANTIZATION_HEADROOM * moved + TOLERANCE * rounding).all())
    assert bool((_block_max(x.abs()) > 0).all())  # every block has a scale: the bound is not vacuous


@pytest.mark.parametrize("form", FORMATS)
def test_a_row_gets_the_same_bits_whatever_the_rows_and_threads(isa: str, form: str) -> None:
    weight = _weight(form, 21, 320, 3)
    x = torch.randn(45, 320, generator=torch.Generator().manual_seed(4))  # [n, C]: two chunks
    together = _threads(1, lambda: packed_linear(x, weight, None))
    assert together is not None
    assert torch.equal(together, _threads(2, lambda: packed_linear(x, weight, None)))
    for r in (0, 31, 32, 44):
        assert torch.equal(packed_linear(x[r : r + 1], weight, None), together[r : r + 1])


@pytest.mark.skipif(len(ISAS) < 2, reason="no AVX2 + FMA + F16C here")
@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocks_give_the_same_bits(form: str, dtype: torch.dtype) -> None:
    """Every block this CPU runs gives the portable block's bits, at 1 row (its paired blocks) and 7."""
    weight = _weight(form, 13, 200, 5)
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(6)).to(dtype)  # [n, C]
    assert isinstance(weight, Int8Weight | Int4Weight)
    fmt, group = ("int8", 0) if isinstance(weight, Int8Weight) else ("int4", weight.group)
    projection = tuple(weight.tensors()) if fmt == "int4" else (*weight.tensors(), None)
    for rows in (x[:1], x):
        portable = cpu_packed.linear(rows, projection, fmt, group, None, "portable")  # type: ignore[arg-type]
        for block in ISAS[1:]:
            assert torch.equal(portable, cpu_packed.linear(rows, projection, fmt, group, None, block))  # type: ignore[arg-type]


@pytest.mark.parametrize("form", FORMATS)
def test_bf16_rows_are_fp32_rows_rounded_once(form: str) -> None:
    weight = _weight(form, 9, 128, 7)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(8)).bfloat16()  # [n, C]
    wide = packed_linear(x.float(), weight, None)
    assert wide is not None and torch.equal(packed_linear(x, weight, None), wide.bfloat16())


def test_what_the_kernel_takes() -> None:
    weight = _weight("int4", 8, 128, 9)
    x = torch.randn(2, 128)
    assert packed_linear(x.half(), weight, None) is None  # fp16: the caller's dense weight
    assert packed_linear(x.requires_grad_(), weight, None) is None
    odd_group = evolve(weight, group=96)  # not whole superblocks
    assert packed_linear(torch.randn(2, 128), odd_group, None) is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("packed_linear") / "mixtral")


@pytest.mark.parametrize("form", FORMATS)
def test_the_model_keeps_q_k_v_and_o_packed_and_runs_them_by_the_kernel(folder, form: str) -> None:
    model = load_model(folder, packing=Packing("native", form))  # type: ignore[arg-type]
    lw = model.weights.layers[0]
    assert lw.attention_packed is not None
    qkv, o = lw.attention_packed
    assert torch.equal(qkv.dequantize(lw.attn.qkv.dtype), lw.attn.qkv)  # the dense copy: the GPU's
    assert torch.equal(o.dequantize(lw.attn.o.dtype), lw.attn.o)
    hidden = torch.randn(3, model.spec.hidden, generator=torch.Generator().manual_seed(0))  # [T, hidden]
    x = torch.randn(3, model.spec.attention.q_width, generator=torch.Generator().manual_seed(1))  # [T, q]
    expected_o = packed_linear(x, o, lw.attn.o_bias)
    assert expected_o is not None
    assert torch.equal(model._projection(0, 1, x, lw.attn.o, lw.attn.o_bias), expected_o)
    assert not torch.equal(expected_o, x @ lw.attn.o.T)  # int8 activations: not the dense product
    # a copy of the layer without the packed weights (as the runtime's device copies are): the same bits
    fields = {name: getattr(lw.attn, name).clone() for name in ("qkv", "o")}
    copy = evolve(lw, attn=evolve(lw.attn, **fields), attention_packed=None)
    rope = model.rope(TokenLayout((0,), (3,), (0,)))
    ours = model.pre_attention(0, hidden, rope, copy)
    assert all(torch.equal(a, b) for a, b in zip(ours, model.pre_attention(0, hidden, rope), strict=True))
