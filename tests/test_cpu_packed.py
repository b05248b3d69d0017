"""kernels.cpu_packed: expert FFNs from int8 / int4 weights as packed compute what dequantizing them
in torch and multiplying does, give a row the same bits whatever the rows and threads beside it, and
are what MoEModel runs for packed experts on the CPU (else the torch fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import Residency
from flowmoe.kernels import cpu_packed, native
from flowmoe.model.loading import load_model, pack_experts
from flowmoe.model.packed_experts import kernel_form, packed_scaled
from flowmoe.model.quantize import quantize_expert
from flowmoe.model.quantized import PackedFFN, QuantizedExpert
from flowmoe.model.weights import FFNWeights
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_scheduler
from tests.test_cpu_experts import _error, _moe, _threads

pytestmark = pytest.mark.skipif(cpu_packed.kernel() is None, reason="no C compiler for the CPU kernels here")
ISAS = ["portable", *(["avx2"] if {"avx2", "fma", "f16c"} <= native.cpu_flags() else [])]
FORMATS = ["int8", "int4", "hqq4"]  # hqq4: int4's layout at group 64
# As tests/test_cpu_experts.py's fp32 bound (max error over a first-order bound of fp32 rounding, with
# the dequantized weights as the weights): the kernel rounds like dequantize-then-multiply but for
# taking each group's scale (int8: the row's) once per sum instead of once per weight, one rounding
# within that bound; a wrong level, zero, scale, row or column is off by O(1). int4 also sums the
# levels q x and takes zero x sum x once per group (cpu_packed.c's header): its sums round terms of
# scale (|q| + |zero|) |x| where dequantize-then-multiply's are scale |q - zero| |x|, so to first order
# its error is that bound times the expert's largest row ratio sum (|q| + |zero|) / sum |q - zero|
# (_level_spread: 1 for int8; ~9-12 for the normal weights here, whose levels gather at the zero).
TOLERANCE = 1e-5
BF16_TOLERANCE = 3 * 2**-8  # of the largest output: the output's one bf16 rounding, 3 ulp


def _expert(seed: int, hidden: int, inter: int, form: str, bias: bool, dtype: torch.dtype) -> QuantizedExpert:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * inter, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(hidden, inter, generator=generator) * inter**-0.5
    biases = (
        (torch.randn(2 * inter, generator=generator), torch.randn(hidden, generator=generator))
        if bias
        else ()
    )
    ffn = FFNWeights(gate_up.to(dtype), down.to(dtype), *(b.to(dtype) for b in biases))
    return quantize_expert(ffn, form, torch.device("cpu"))  # type: ignore[arg-type]


def _kernel(expert: QuantizedExpert) -> tuple[str, int, cpu_packed.PackedFFN]:
    form = kernel_form(expert)
    assert form is not None
    return form


def _level_spread(fmt: str, group: int, ffn: cpu_packed.PackedFFN) -> float:
    """The largest sum (|q| + |zero|) / sum |q - zero| over the rows of ffn's int4 projections (the
    factor by which the kernel's first-order rounding bound exceeds TOLERANCE's), 1 for int8."""
    if fmt == "int8":
        return 1.0
    spread = 1.0
    for q, _, zero in ffn[:3]:
        assert zero is not None
        levels = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1).double()  # [R, 2 * bytes]
        zeros = zero.double().repeat_interleave(group, dim=1)[:, : levels.shape[1]]  # [R, 2 * bytes]
        ratio = (levels.abs() + zeros.abs()).sum(1) / (levels - zeros).abs().sum(1).clamp(min=1e-30)  # [R]
        spread = max(spread, float(ratio.max()))
    return spread


def _dequantized(expert: QuantizedExpert) -> tuple:
    ffn = expert.to_ffn()
    return ffn.gate_up, ffn.down, ffn.gate_up_bias, ffn.down_bias


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FLOWMOE_CPU_ISA", request.param)
    assert cpu_packed.isa() == request.param
    return str(request.param)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, cpu_packed.MAX_ROWS),
    hidden=st.sampled_from([16, 40, 72, 136]),  # int4 groups ragged at the row's end, tails past 16
    inter=st.sampled_from([8, 24, 48]),
    form=st.sampled_from(FORMATS),
    bias=st.booleans(),
    activation=st.sampled_from(["silu", "clamped_swiglu"]),
    block=st.sampled_from(ISAS),
    seed=st.integers(0, 2**16),
)
def test_matches_dequantize_then_multiply(
    rows: int, hidden: int, inter: int, form: str, bias: bool, activation: str, block: str, seed: int
) -> None:
    moe = _moe(activation)
    expert = _expert(seed, hidden, inter, form, bias, torch.float32)
    fmt, group, ffn = _kernel(expert)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed + 1)) * 3
    assert cpu_packed.fits(x, ffn, fmt, group)
    out = cpu_packed.swiglu_group([x], [ffn], fmt, group, moe, block)[0]
    assert out.shape == (rows, hidden) and out.dtype == torch.float32
    assert _error(out, x, _dequantized(expert), moe) <= TOLERANCE * _level_spread(fmt, group, ffn)


@pytest.mark.parametrize("form", FORMATS)
def test_bf16_rows_round_once(form: str) -> None:
    """A bf16 model: x widened, fp32 throughout, the output rounded to bf16 once."""
    moe = _moe("silu")
    expert = _expert(3, 72, 24, form, False, torch.bfloat16)
    fmt, group, ffn = _kernel(expert)
    x = torch.randn(5, 72).bfloat16()
    out = cpu_packed.swiglu_group([x], [ffn], fmt, group, moe)[0]
    weights = evolve(expert, dtype=torch.float32).to_ffn()  # dequantized to float32 (to bf16 it would round)
    gate, up = (x.double() @ weights.gate_up.double().T).chunk(2, dim=-1)  # [5, 24] each
    reference = (torch.nn.functional.silu(gate) * up) @ weights.down.double().T  # [5, 72]
    assert out.dtype == torch.bfloat16
    assert float((out.double() - reference).abs().max() / reference.abs().max()) <= BF16_TOLERANCE


@pytest.mark.parametrize("form", FORMATS)
def test_a_row_gets_the_same_bits_whatever_the_rows_and_threads(isa: str, form: str) -> None:
    """Each of 3 experts with 1, 7 and 32 rows in one call, at 1 and 2 threads, and each row alone:
    the same bits (the summation order is fixed per output)."""
    moe = _moe("silu")
    experts = [_kernel(_expert(seed, 136, 48, form, seed == 1, torch.float32)) for seed in range(3)]
    fmt, group = experts[0][:2]
    ffns = [e[2] for e in experts]
    xs = [torch.randn(n, 136, generator=torch.Generator().manual_seed(n)) for n in (1, 7, 32)]
    together = _threads(1, lambda: cpu_packed.swiglu_group(xs, ffns, fmt, group, moe))
    two_threads = _threads(2, lambda: cpu_packed.swiglu_group(xs, ffns, fmt, group, moe))
    assert all(torch.equal(a, b) for a, b in zip(together, two_threads, strict=True))
    for x, ffn, out in zip(xs, ffns, together, strict=True):
        for r in range(len(x)):
            alone = cpu_packed.swiglu_group([x[r : r + 1]], [ffn], fmt, group, moe)[0]
            assert torch.equal(alone, out[r : r + 1])


def test_what_the_kernels_take() -> None:
    expert = _expert(0, 72, 24, "int4", False, torch.float32)
    fmt, group, ffn = _kernel(expert)
    x = torch.randn(4, 72)
    assert cpu_packed.fits(x, ffn, fmt, group)
    assert not cpu_packed.fits(torch.randn(cpu_packed.MAX_ROWS + 1, 72), ffn, fmt, group)  # a GEMM's rows
    assert not cpu_packed.fits(x.half(), ffn, fmt, group)
    assert not cpu_packed.fits(torch.randn(4, 64), ffn, fmt, group)  # another hidden size
    assert not cpu_packed.fits(x, ffn, fmt, 24)  # a group not a multiple of 16
    assert not cpu_packed.fits(x, ffn, fmt, 2 * cpu_packed.MAX_GROUP)
    assert not cpu_packed.fits(x, ffn, "int8", 0)  # int4 tensors read as int8


def test_the_model_runs_packed_experts_by_the_kernels_else_dequantizes() -> None:
    """packed_scaled takes a group of PackedFFNs (the floats of the kernel, scaled by the combine
    weights), an expert of more rows than one call takes in pieces with each piece's bits, and gives
    None (the caller's torch path) for an expert in a layout they do not read; a PackedFFN's tensors
    read are its dequantization."""
    moe = _moe("silu")
    experts = [_expert(seed, 72, 24, "int4", False, torch.float32) for seed in range(2)]
    ffns: list[FFNWeights] = [e.as_ffn() for e in experts]
    counts = [3, 2]
    gathered, scales = torch.randn(5, 72), torch.rand(5, 1)
    outs = packed_scaled(gathered, scales, counts, ffns, moe)
    assert outs is not None
    kernel = cpu_packed.swiglu_group(
        list(gathered.split(counts)), [_kernel(e)[2] for e in experts], "int4", 128, moe
    )
    for out, expected, rows in zip(outs, kernel, scales.split(counts), strict=True):
        assert torch.equal(out, expected * rows)
    many = [2 * cpu_packed.MAX_ROWS + 5, 3]  # prefill: three pieces, then one
    x, w = torch.randn(sum(many), 72), torch.rand(sum(many), 1)
    outs = packed_scaled(x, w, many, ffns, moe)
    assert outs is not None and [len(o) for o in outs] == many
    pieces = [cpu_packed.MAX_ROWS, cpu_packed.MAX_ROWS, 5, 3]
    alone = [
        cpu_packed.swiglu_group([piece], [_kernel(experts[e])[2]], "int4", 128, moe)[0]
        for piece, e in zip(x.split(pieces), [0, 0, 0, 1], strict=True)
    ]
    assert torch.equal(torch.cat(outs), torch.cat(alone) * w)
    dense = FFNWeights(*_dequantized(experts[0]))
    assert packed_scaled(gathered[:3], scales[:3], [3], [dense], moe) is None  # not packed
    mixed = [ffns[0], _expert(0, 72, 24, "int8", False, torch.float32).as_ffn()]
    assert packed_scaled(gathered, scales, counts, mixed, moe) is None  # two formats: no one call
    packed = ffns[0]
    assert isinstance(packed, PackedFFN)
    assert torch.equal(packed.gate_up, experts[0].to_ffn().gate_up)


def test_a_host_only_runtime_keeps_packed_experts_packed_and_runs_them_by_the_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the "GPU" is the host, a resident packed expert (copied whole or in pages) is the host's
    packed expert itself, handed out as a PackedFFN, and a run computes its decode steps' experts by
    the packed kernels (their tokens are eager's: tests/test_quantized_experts.py)."""
    folder = save_hf(hf_model("mixtral"), tmp_path / "mixtral")
    model = load_model(folder)
    pack_experts(model, folder, "int4")
    weights = DeviceWeights(model, Devices(torch.device("cpu")), expert_format="int4")
    weights.setup(Residency.dense_only(model.spec), 2 * model.spec.expert_bytes)  # room for two
    weights.load(0, 1)
    weights.load(0, 2, 0, 2, 1)
    weights.load(0, 2, 1, 2, 1)
    for expert in (1, 2):
        resident = weights.expert(0, expert)
        assert isinstance(resident, PackedFFN) and resident.expert is model.weights.layers[0].packed[expert]
    weights.close()
    calls = []
    kernel = cpu_packed.swiglu_group
    monkeypatch.setattr(cpu_packed, "swiglu_group", lambda *args: calls.append(1) or kernel(*args))
    policy = Policy(micro_batch_size=3, micro_batches=2, expert_format="int4")
    run_scheduler(model, "eager", policy, device="cpu")
    assert calls
