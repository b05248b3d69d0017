"""kernels.cpu_packed: expert FFNs from int8 / int4 weights as packed compute what dequantizing them
in torch and multiplying does, give a row the same bits whatever the rows and threads beside it, and
are what MoEModel runs for packed experts on the CPU (else the torch fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import Residency
from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_packed, native
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.packed_experts import kernel_form, packed_scaled, prepared
from flowmoe.model.quantize import quantize_expert
from flowmoe.model.quantized import Int4Weight, Int8Weight, PackedFFN, QuantizedExpert
from flowmoe.model.weights import FFNWeights
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_scheduler
from tests.test_cpu_experts import _moe, _reference, _threads

pytestmark = pytest.mark.skipif(cpu_packed.kernel() is None, reason="no C compiler for the CPU kernels here")
ISAS = [b for b in cpu_packed.BLOCKS if cpu_packed.NEEDS[b] <= native.cpu_flags()]  # the blocks this CPU runs
FORMATS = ["int8", "int4", "hqq4"]  # hqq4: int4's layout at group 64
# The kernels quantize the activations (x, and the activation between the projections) per block of
# QB values to levels times a scale d = max |x| / QMAX (cpu_packed.c's header, llama.cpp's Q8_0), and
# are checked twice:
# * against the same quantization in float64 (_levels, bit for bit the kernels' levels of x), to
#   tests/test_cpu_experts.py's fp32 bound (max error over a first-order bound of fp32 rounding, the
#   dequantized weights as the weights) plus, for the activation between the projections, what its
#   fp32 error can move its levels by: its scale's share and one level where it lies within that
#   error of a rounding boundary (_same_quantization_error). The integer sums are exact and the
#   floats sum one product per block, within TOLERANCE; int4 sums the levels q x and takes zero x
#   sum x once per group: its sums round terms of scale (|q| + |zero|) |x| where a sum of the
#   dequantized weights' are scale |q - zero| |x|, so to first order its error is that bound times
#   the expert's largest row ratio sum (|q| + |zero|) / sum |q - zero| (_level_spread: 1 for int8;
#   ~9-12 for the normal weights here, whose levels gather at the zero). A wrong level, zero, scale,
#   row or column is off by O(1).
# * against dequantize-then-multiply on the unquantized activations, to the first-order bound of
#   each activation off by at most d / 2 (round to nearest), carried through the FFN as the fp32
#   bound carries rounding, times QUANTIZATION_HEADROOM for the second-order terms
#   (_quantization_bound).
TOLERANCE = 1e-5
QB = 32  # cpu_packed.c's activations per block (llama.cpp's QK8_0)
QMAX = 127  # cpu_packed.c's largest activation level (Q8_0's)
QUANTIZATION_HEADROOM = 2.0


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


Float64FFN = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _float64(expert: QuantizedExpert) -> Float64FFN:
    """The dequantized expert in float64: gate_up [2I, hidden], down [hidden, I] and their biases."""
    ffn = expert.to_ffn()
    gate_up_bias, down_bias = (None if b is None else b.double() for b in (ffn.gate_up_bias, ffn.down_bias))
    return ffn.gate_up.double(), ffn.down.double(), gate_up_bias, down_bias


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FLOWMOE_CPU_ISA", request.param)
    assert cpu_packed.isa() == request.param
    return str(request.param)


def _levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] as the kernels quantize it (cpu_packed.c's quantize_row, in float32 as it does):
    (its values d x level [n, K] and each value's block scale d [n, K], float64)."""
    n, k = x.shape
    blocks = F.pad(x.float(), (0, -k % QB)).view(n, -1, QB)  # [n, ceil(K / QB), QB]
    d = blocks.abs().amax(dim=-1, keepdim=True) / QMAX  # [n, blocks, 1]
    v = blocks * torch.where(d != 0, 1 / d, 0)  # [n, blocks, QB]
    whole = torch.trunc(v)
    level = torch.where((v - whole).abs() == 0.5, whole + torch.sign(v), torch.round(v))  # roundf's ties
    values = (level.double() * d.double()).view(n, -1)[:, :k]  # [n, K]
    return values, d.double().expand_as(blocks).reshape(n, -1)[:, :k]


def _block_max(t: torch.Tensor) -> torch.Tensor:
    """t [n, K] -> each value's block's largest value [n, K]."""
    n, k = t.shape
    blocks = F.pad(t, (0, -k % QB)).view(n, -1, QB)  # [n, blocks, QB]
    return blocks.amax(dim=-1, keepdim=True).expand_as(blocks).reshape(n, -1)[:, :k]


def _projections(x: torch.Tensor, expert: QuantizedExpert, moe: MoESpec) -> tuple:
    """x [n, hidden] float64 through the dequantized expert's gate/up: (act, gate, up, |gate| spread,
    |up| spread) [n, I] each, the spreads |W| @ |x| + |bias| (the first-order bound of fp32 rounding)."""
    gate_up, down, gate_up_bias, _ = _float64(expert)
    eye = torch.eye(down.shape[1], dtype=torch.float64)
    act = _reference(x, (gate_up, eye, gate_up_bias, None), moe)  # [n, I]: the identity keeps it exact
    gate, up = F.linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    bias = gate_up_bias.abs() if gate_up_bias is not None else None
    spread_gate, spread_up = F.linear(x.abs(), gate_up.abs(), bias).chunk(2, dim=-1)
    return act, gate, up, spread_gate, spread_up


def _act_bound(
    gate: torch.Tensor, up: torch.Tensor, d_gate: torch.Tensor, d_up: torch.Tensor, moe: MoESpec
) -> torch.Tensor:
    """First order, what the activation moves by where gate and up move by d_gate and d_up (as
    tests/test_cpu_experts.py's _error: slopes within (|up| + 1)(1 + alpha) and |gate| + 1)."""
    return (up.abs() + 1) * (1 + moe.swiglu_alpha) * d_gate + (gate.abs() + 1) * d_up


def _same_quantization_error(
    out: torch.Tensor, x: torch.Tensor, expert: QuantizedExpert, moe: MoESpec, spread: float
) -> float:
    """max |out - reference| over its bound (the header), the reference the dequantized weights
    times the kernels' quantized x and activation in float64."""
    _, down, _, down_bias = _float64(expert)
    act, gate, up, spread_gate, spread_up = _projections(_levels(x)[0], expert, moe)
    spread_act = (up.abs() + 1) * gate.abs() + _act_bound(gate, up, spread_gate, spread_up, moe)  # [n, I]
    rounding = TOLERANCE * spread * spread_act
    values, d = _levels(act)
    moved = rounding + _block_max(rounding)  # the act's fp32 error, and its share of its block's d x level
    near = ((act / d).abs().frac() - 0.5).abs() <= moved / d  # [n, I]: a level the kernel may round apart
    reference = F.linear(values, down, down_bias)  # [n, hidden]
    bound = F.linear(moved + d * near, down.abs()) + TOLERANCE * spread * F.linear(values.abs(), down.abs())
    if down_bias is not None:
        bound = bound + TOLERANCE * down_bias.abs()
    return float(((out.double() - reference).abs() / bound.clamp(min=1e-30)).max())


def _quantization_bound(x: torch.Tensor, expert: QuantizedExpert, moe: MoESpec) -> torch.Tensor:
    """[n, hidden]: how far the kernels may be from dequantize-then-multiply (the header): each value
    of x and of the activation off by d / 2 of its block, to first order, times the headroom (which
    also holds the fp32 rounding, 1e-5 of a like bound)."""
    gate_up, down = _float64(expert)[:2]
    act, gate, up = _projections(x.double(), expert, moe)[:3]
    moved_gate, moved_up = F.linear(_levels(x)[1] / 2, gate_up.abs()).chunk(2, dim=-1)  # [n, I] each
    moved = _act_bound(gate, up, moved_gate, moved_up, moe)  # [n, I]
    d_act = _block_max(act.abs() + moved) / QMAX  # [n, I]: at least the scale of the kernel's act's blocks
    return QUANTIZATION_HEADROOM * F.linear(moved + d_act / 2, down.abs())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, cpu_packed.MAX_ROWS),
    hidden=st.sampled_from([16, 40, 72, 136, 320]),  # groups ragged at the row's end, tails past 64
    inter=st.sampled_from([8, 24, 48, 192]),
    form=st.sampled_from(FORMATS),
    bias=st.booleans(),
    activation=st.sampled_from(["silu", "clamped_swiglu"]),
    block=st.sampled_from(ISAS),
    seed=st.integers(0, 2**16),
)
def test_matches_the_quantized_activations_in_float64_and_dequantize_then_multiply(
    rows: int, hidden: int, inter: int, form: str, bias: bool, activation: str, block: str, seed: int
) -> None:
    moe = _moe(activation)
    expert = _expert(seed, hidden, inter, form, bias, torch.float32)
    fmt, group, ffn = _kernel(expert)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed + 1)) * 3
    assert cpu_packed.fits(x, ffn, fmt, group)
    out = cpu_packed.swiglu_group([x], [ffn], fmt, group, moe, block)[0]
    assert out.shape == (rows, hidden) and out.dtype == torch.float32
    spread = _level_spread(fmt, group, ffn)
    assert _same_quantization_error(out, x, expert, moe, spread) <= 1
    dequantized = _reference(x, _dequantized(expert), moe)  # [rows, hidden]
    assert bool(((out.double() - dequantized).abs() <= _quantization_bound(x, expert, moe)).all())


@pytest.mark.parametrize("form", FORMATS)
def test_bf16_rows_are_fp32_rows_rounded_once(form: str) -> None:
    """A bf16 model: x widened (exactly), fp32 throughout, the output rounded to bf16 once: the fp32
    kernel's bits on the widened x, rounded."""
    moe = _moe("silu")
    expert = _expert(3, 136, 48, form, False, torch.bfloat16)
    fmt, group, ffn = _kernel(expert)
    x = torch.randn(5, 136).bfloat16()
    out = cpu_packed.swiglu_group([x], [ffn], fmt, group, moe)[0]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_packed.swiglu_group([x.float()], [ffn], fmt, group, moe)[0].bfloat16())


def _same_in_every_block(
    xs: list[torch.Tensor], ffns: list[cpu_packed.PackedFFN], fmt: str, group: int, moe: MoESpec
) -> bool:
    """Whether `swiglu_group` gives the portable block's bits in each block this CPU runs."""
    portable = cpu_packed.swiglu_group(xs, ffns, fmt, group, moe, "portable")
    return all(
        torch.equal(a, b)
        for block in ISAS[1:]
        for a, b in zip(portable, cpu_packed.swiglu_group(xs, ffns, fmt, group, moe, block), strict=True)
    )


@pytest.mark.skipif(len(ISAS) < 2, reason="no AVX2 + FMA + F16C here")
@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocks_give_the_same_bits(form: str, dtype: torch.dtype) -> None:
    """Every float operation in one order in every block (cpu_packed.c's header), over full blocks
    and superblocks, ragged groups and tails, 1 to 32 rows (each tile height)."""
    moe = _moe("clamped_swiglu")
    for hidden, inter in ((136, 48), (320, 192)):
        expert = _expert(hidden, hidden, inter, form, True, dtype)
        fmt, group, ffn = _kernel(expert)
        rows = (1, 2, 3, 7, 32)
        xs = [torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)).to(dtype) for n in rows]
        ffns = [ffn] * len(rows)
        assert _same_in_every_block(xs, ffns, fmt, group, moe)


def _int4(rows: int, cols: int, group: int, generator: torch.Generator) -> Int4Weight:
    """A random Int4Weight [rows, cols] at `group` (levels, scales and zeros as any packer may give)."""
    groups = -(-cols // group)
    packed = torch.randint(0, 256, (rows, -(-cols // 2)), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, groups, generator=generator) * 0.1).half()
    zero = (torch.rand(rows, groups, generator=generator) * 15).half()
    return Int4Weight(packed, scale, zero, group, cols)


@pytest.mark.skipif(len(ISAS) < 2, reason="no AVX2 + FMA + F16C here")
@pytest.mark.parametrize("group", [192, 256])
def test_the_blocks_agree_at_groups_of_more_superblocks(group: int) -> None:
    """int4 groups other than 64 and 128 (a converted GPTQ / AWQ checkpoint's) take the x86 blocks'
    general group loop: the portable block's bits, whole groups and a short last one."""
    generator = torch.Generator().manual_seed(group)
    hidden, inter = 3 * group + 72, 2 * group + 136  # a short last group, then a tail past 64
    expert = QuantizedExpert(
        (_int4(2 * inter, hidden, group, generator),), _int4(hidden, inter, group, generator), torch.float32
    )
    fmt, kernel_group, ffn = _kernel(expert)
    xs = [torch.randn(n, hidden, generator=generator) for n in (1, 5)]
    moe = _moe("silu")
    assert kernel_group == group
    assert _same_in_every_block(xs, [ffn] * 2, fmt, kernel_group, moe)


@pytest.mark.skipif(len(ISAS) < 2, reason="no AVX2 + FMA + F16C here")
@pytest.mark.parametrize("form", FORMATS)
def test_the_blocks_quantize_ties_and_empty_blocks_alike(form: str) -> None:
    """Every block's activation quantization (cpu_packed.c's quantize_row; cpu_packed_avx2.c's for
    whole blocks) rounds a tie half away from zero: blocks whose largest |x| is QMAX (d 1, each x its own
    level before rounding) of half-integers of both signs, a block of zeros and one of -0.0 (d 0)."""
    hidden = 320  # 5 superblocks: int4's groups of 128 with a short last one, hqq4's of 64
    fmt, group, ffn = _kernel(_expert(7, hidden, 48, form, False, torch.float32))
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(-QMAX, QMAX, (4, hidden), generator=generator) + 0.5  # [4, hidden]: every x a tie
    x[:, ::QB] = QMAX  # each block's largest |x|
    x[1, QB : 2 * QB], x[2, 2 * QB : 3 * QB] = 0.0, -0.0
    moe = _moe("silu")
    assert _same_in_every_block([x], [ffn], fmt, group, moe)


@pytest.mark.parametrize("form", FORMATS)
def test_a_row_gets_the_same_bits_whatever_the_rows_and_threads(isa: str, form: str) -> None:
    """Each of 3 experts with 1, 7 and 32 rows in one call, at 1, 2 and 3 threads, and each row alone:
    the same bits (the summation order is fixed per output)."""
    moe = _moe("silu")
    experts = [_kernel(_expert(seed, 136, 48, form, seed == 1, torch.float32)) for seed in range(3)]
    fmt, group = experts[0][:2]
    ffns = [e[2] for e in experts]
    xs = [torch.randn(n, 136, generator=torch.Generator().manual_seed(n)) for n in (1, 7, 32)]
    together = _threads(1, lambda: cpu_packed.swiglu_group(xs, ffns, fmt, group, moe))
    for threads in (2, 3):  # the threads' spans of the experts' blocks (shares.h) split them otherwise
        wider = _threads(threads, lambda: cpu_packed.swiglu_group(xs, ffns, fmt, group, moe))
        assert all(torch.equal(a, b) for a, b in zip(together, wider, strict=True))
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
    assert not cpu_packed.fits(x, ffn, fmt, 96)  # a group not whole superblocks (cpu_packed.GROUP_STEP)
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


def test_an_expert_is_prepared_once_and_again_where_a_tensor_is_rebound() -> None:
    """packed_experts.prepared checks an expert and takes its pointers once, and again where one of its
    tensors is rebound (model/arena.py's packing): the kernel then reads the new tensor."""
    moe = _moe("silu")
    expert = _expert(0, 72, 24, "int8", False, torch.float32)
    first = prepared(expert)
    assert first is not None and prepared(expert) is first
    x, scales = torch.randn(2, 72), torch.ones(2, 1)
    before = packed_scaled(x, scales, [2], [expert.as_ffn()], moe)
    down = expert.down
    assert isinstance(down, Int8Weight) and before is not None
    down.values = -down.values  # a new tensor: the output negated, exactly
    assert prepared(expert) is not first
    after = packed_scaled(x, scales, [2], [expert.as_ffn()], moe)
    assert after is not None and torch.equal(after[0], -before[0])


def test_a_host_only_runtime_keeps_packed_experts_packed_and_runs_them_by_the_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the "GPU" is the host, a resident packed expert (copied whole or in pages) is the host's
    packed expert itself, handed out as a PackedFFN, and a run computes its decode steps' experts by
    the packed kernels (their tokens are eager's: tests/test_quantized_experts.py)."""
    folder = save_hf(hf_model("mixtral"), tmp_path / "mixtral")
    model = load_model(folder, packing=Packing("int4"))
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
    kernel = cpu_packed.swiglu_prepared
    monkeypatch.setattr(cpu_packed, "swiglu_prepared", lambda *args: calls.append(1) or kernel(*args))
    policy = Policy(micro_batch_size=3, micro_batches=2, expert_format="int4")
    run_scheduler(model, "eager", policy, device="cpu")
    assert calls
