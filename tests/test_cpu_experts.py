"""kernels.cpu_expert: the CPU's few-row projections and expert FFNs compute what plain torch does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import structlog
import structlog.testing
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert, experts, native
from flowmoe.kernels.experts import swiglu_ffn, swiglu_ffn_group, swiglu_ffn_torch
from flowmoe.kernels.linear import FEW_ROWS, linear
from tests.helpers import rel_err

compiled = pytest.mark.skipif(cpu_expert.library() is None, reason="no C compiler for the CPU kernels here")
# of the largest output: a bf16 product is rounded once (3 ulp of 2^-8); a wrong row, column or
# weight is off by O(1)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3 * 2**-8}


def _moe(activation: str) -> MoESpec:
    return MoESpec(experts=4, top_k=2, intermediate=8, activation=activation)


def _tensor(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale


def _reference(x: torch.Tensor, ffn: tuple, moe: MoESpec) -> torch.Tensor:
    """The expert FFN in float64 on the inputs' values."""
    gate_up, down, gate_up_bias, down_bias = (t.double() if t is not None else None for t in ffn)
    gate, up = F.linear(x.double(), gate_up, gate_up_bias).chunk(2, dim=-1)
    if moe.activation == "clamped_swiglu":
        gate = gate.clamp(max=moe.swiglu_limit)
        up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))
    else:
        act = F.silu(gate) * up
    return F.linear(act, down, down_bias)


def _error(out: torch.Tensor, x: torch.Tensor, ffn: tuple, moe: MoESpec) -> float:
    """max |out - exact| over a first-order bound of what rounding in fp32 can move an output by:
    |down| @ (|act| + the activation's slopes times |gate_up| @ |x|) + |down_bias| (a large output
    of cancelling terms has a large bound; a wrong row, column or weight is off by O(1))."""
    exact = _reference(x, ffn, moe)
    gate_up, down, gate_up_bias, down_bias = (t.double().abs() if t is not None else None for t in ffn)
    gate, up = F.linear(x.double(), ffn[0].double(), None).chunk(2, dim=-1)
    spread_gate, spread_up = F.linear(x.double().abs(), gate_up, gate_up_bias).chunk(2, dim=-1)
    slope = 1 + moe.swiglu_alpha  # d(gate * sigmoid(alpha * gate)) / d gate is within 1 + alpha
    act = (up.abs() + 1) * gate.abs() + (up.abs() + 1) * slope * spread_gate + (gate.abs() + 1) * spread_up
    bound = F.linear(act, down, down_bias)  # [n, hidden]
    return float(((out.double() - exact).abs() / bound.clamp(min=1e-30)).max())


def _ffn(generator: torch.Generator, hidden: int, inter: int, dtype: torch.dtype, bias: bool) -> tuple:
    gate_up = _tensor(generator, 2 * inter, hidden, scale=hidden**-0.5).to(dtype)
    down = _tensor(generator, hidden, inter, scale=inter**-0.5).to(dtype)
    if not bias:
        return gate_up, down, None, None
    return gate_up, down, _tensor(generator, 2 * inter).to(dtype), _tensor(generator, hidden).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, cpu_expert.MAX_ROWS + 8),
    n_in=st.integers(1, 70),
    n_out=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_float64(
    rows: int, n_in: int, n_out: int, dtype: torch.dtype, bias: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = _tensor(generator, rows, n_in).to(dtype)
    weight = _tensor(generator, n_out, n_in).to(dtype)
    b = _tensor(generator, n_out).to(dtype) if bias else None
    out = linear(x, weight, b)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert rel_err(out, exact) <= TOLERANCE[dtype]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, cpu_expert.MAX_ROWS + 8),
    hidden=st.integers(1, 48),
    inter=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    activation=st.sampled_from(["silu", "clamped_swiglu"]),
    seed=st.integers(0, 2**16),
)
def test_swiglu_ffn_matches_float64(
    rows: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool, activation: str, seed: int
) -> None:
    """fp32 at any row count; bf16 at the rows the kernels take (`max_rows`), whose roundings are the
    output's and, with the AVX-512 BF16 block, the activation's (torch's bf16 composition rounds the
    projections and each activation op too): each within a first-order bound (`_error`), which a
    cancelling sum keeps apart from a wrong weight."""
    rows = min(rows, cpu_expert.max_rows(dtype))
    generator = torch.Generator().manual_seed(seed)
    moe = _moe(activation)
    ffn = _ffn(generator, hidden, inter, dtype, bias)
    x = (_tensor(generator, rows, hidden) * 3).to(dtype)  # large enough for GPT-OSS's clamps to bite
    out = swiglu_ffn(x, *ffn[:2], moe, *ffn[2:])
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert _error(out, x, ffn, moe) <= TOLERANCE[dtype]
    if dtype == torch.float32:
        assert _error(swiglu_ffn_torch(x, ffn, moe), x, ffn, moe) <= TOLERANCE[dtype]


@compiled
@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(1, cpu_expert.MAX_ROWS), min_size=1, max_size=5),
    bias=st.booleans(),
    activation=st.sampled_from(["silu", "clamped_swiglu"]),
    seed=st.integers(0, 2**16),
)
def test_group_and_row_splits_give_identical_results(
    counts: list[int], bias: bool, activation: str, seed: int
) -> None:
    """A layer's experts in one call give each expert what it gets alone, and a row gets the same
    bits whichever other rows share its call (so a schedule's micro-batches keep eager's tokens)."""
    generator = torch.Generator().manual_seed(seed)
    moe, hidden, inter = _moe(activation), 40, 24
    ffns = [_ffn(generator, hidden, inter, torch.float32, bias) for _ in counts]
    xs = [_tensor(generator, n, hidden).float() for n in counts]
    assert all(cpu_expert.fits_ffn(x, ffn) for x, ffn in zip(xs, ffns, strict=True))
    grouped = swiglu_ffn_group(xs, ffns, moe)
    for x, ffn, out in zip(xs, ffns, grouped, strict=True):
        assert torch.equal(out, swiglu_ffn(x, *ffn[:2], moe, *ffn[2:]))
        assert torch.equal(out[-1:], swiglu_ffn(x[-1:], *ffn[:2], moe, *ffn[2:]))
        assert _error(out, x, ffn, moe) <= TOLERANCE[torch.float32]


@compiled
def test_which_shapes_take_the_kernels() -> None:
    w32, w16 = torch.zeros(8, 16), torch.zeros(8, 16, dtype=torch.bfloat16)
    limit = cpu_expert.max_rows(torch.float32)  # MAX_ROWS, AVX2_MAX_ROWS with the AVX2 / AVX-512 blocks
    assert limit == (cpu_expert.MAX_ROWS if cpu_expert.isa() == "portable" else cpu_expert.AVX2_MAX_ROWS)
    assert cpu_expert.fits(torch.zeros(limit, 16), w32)
    assert not cpu_expert.fits(torch.zeros(limit + 1, 16), w32)  # compute-bound: MKL
    assert cpu_expert.fits(torch.zeros(1, 16, dtype=torch.bfloat16), w16)
    # bf16 rows: all `limit` where torch emulates bf16; where it has native bf16 (AMX, AVX512-BF16),
    # MAX_ROWS with the AVX2 block, AVX512_BF16_ROWS with the AVX-512 one (oneDNN's beyond) and one
    # row with the portable one
    native_bf16 = not cpu_expert.emulated(torch.bfloat16)
    bf16_limit = cpu_expert.max_rows(torch.bfloat16)
    if not native_bf16:
        assert bf16_limit == limit
    else:
        kept = {"portable": 1, "avx2": cpu_expert.MAX_ROWS, "avx512": cpu_expert.AVX512_BF16_ROWS}
        assert bf16_limit == kept[cpu_expert.isa()]
    assert cpu_expert.fits(torch.zeros(bf16_limit, 16, dtype=torch.bfloat16), w16)
    assert not cpu_expert.fits(torch.zeros(bf16_limit + 1, 16, dtype=torch.bfloat16), w16)
    assert not cpu_expert.fits(torch.zeros(2, 16, dtype=torch.float16), w16.half())
    assert not cpu_expert.fits(torch.zeros(2, 16), w32.t().contiguous().t())  # a transposed weight
    assert not cpu_expert.fits(torch.zeros(0, 16), w32)
    assert not cpu_expert.fits(torch.zeros(2, 16, requires_grad=True), w32)
    assert not cpu_expert.fits(torch.zeros(2, 15), w32)  # torch names the mismatch
    assert not cpu_expert.fits(torch.zeros(2, 16), w32, torch.zeros(7))
    gate_up, down = torch.zeros(2 * 24, 16), torch.zeros(16, 24)
    assert cpu_expert.fits_ffn(torch.zeros(3, 16), (gate_up, down, torch.zeros(48), torch.zeros(16)))
    assert not cpu_expert.fits_ffn(torch.zeros(3, 16), (gate_up, down.t().contiguous(), None, None))
    assert not cpu_expert.fits_ffn(torch.zeros(3, 16), (gate_up, down, torch.zeros(24), None))
    assert not cpu_expert.fits_ffn(torch.zeros(3, 16), (gate_up[:47], torch.zeros(16, 23), None, None))


def test_mixed_group_falls_back_per_expert() -> None:
    """Experts the kernels do not take (too many rows, another shape or dtype) still run."""
    generator = torch.Generator().manual_seed(3)
    moe = _moe("silu")
    ffns = [_ffn(generator, 24, 16, torch.float32, True) for _ in range(3)]
    ffns += [_ffn(generator, 24, 8, torch.float32, False), _ffn(generator, 24, 16, torch.bfloat16, True)]
    xs = [_tensor(generator, n, 24).float() for n in (2, cpu_expert.max_rows(torch.float32) + 5, 1, 3)]
    xs.append(_tensor(generator, 1, 24).bfloat16())
    for x, ffn, out in zip(xs, ffns, swiglu_ffn_group(xs, ffns, moe), strict=True):
        assert out.dtype == x.dtype
        assert rel_err(out, _reference(x, ffn, moe)) <= TOLERANCE[x.dtype]  # fp32: one well-scaled case


def test_without_a_compiler_torch_computes_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed build leaves the kernels off (one log line) and every caller on torch's path."""
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(native.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert native.library.__wrapped__() is None
    assert not any(tmp_path.rglob("*.so"))  # nothing half-written into the cache
    monkeypatch.setattr(cpu_expert, "library", lambda: None)
    generator = torch.Generator().manual_seed(5)
    moe, ffn = _moe("silu"), _ffn(generator, 20, 12, torch.float32, True)
    x = _tensor(generator, 3, 20).float()
    assert not cpu_expert.fits(x, ffn[0])
    out = swiglu_ffn(x, *ffn[:2], moe, *ffn[2:])
    assert rel_err(out, _reference(x, ffn, moe)) <= TOLERANCE[torch.float32]


def test_missing_compiler_is_one_clear_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CC naming a program that is not there, and no cc/gcc on PATH: one warning that names the
    compiler and the slower fallback, no traceback, nothing written (issue 27 item 9)."""
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("FLOWMOE_CPU_KERNELS", raising=False)
    with structlog.testing.capture_logs() as logs:
        assert native.library.__wrapped__() is None
    assert [entry["log_level"] for entry in logs] == ["warning"]
    assert "no C compiler found" in logs[0]["reason"] and "no-such-cc" in logs[0]["reason"]
    assert "torch's slower path" in logs[0]["effect"]
    assert not any(tmp_path.iterdir())


def test_kernel_cache_folder_follows_flowmoe_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path / "home"))
    assert native.cache_folder() == tmp_path / "home"
    monkeypatch.setenv("FLOWMOE_HOME", "")  # empty is unset, as for the built-in model
    assert native.cache_folder() == tmp_path / "xdg" / "flowmoe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert native.cache_folder() == Path.home() / ".cache" / "flowmoe"


@compiled
def test_build_is_cached_per_source_and_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path / "home"))  # FLOWMOE_HOME moves it (issue 27 item 9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.library.__wrapped__() is not None
    built = list((tmp_path / "home").glob("kernels-*.so"))
    assert len(built) == 1 and list(tmp_path.rglob("*")) == [tmp_path / "home", built[0]]
    stamp = built[0].stat().st_mtime_ns
    assert native.library.__wrapped__() is not None  # found, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp


# ---- the kernels' blocks by CPU feature: each available one against float64, thread counts, splits

T = TypeVar("T")
ISAS = [name for name, needs in cpu_expert.NEEDS.items() if needs <= native.cpu_flags()]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """FLOWMOE_CPU_ISA forcing each block this CPU can run; bf16 from two rows on taken as where
    torch emulates bf16 (so that the kernels see every row count on any CPU)."""
    monkeypatch.setenv("FLOWMOE_CPU_ISA", request.param)
    monkeypatch.setattr(cpu_expert, "max_rows", lambda dtype: cpu_expert.MAX_ROWS)
    assert cpu_expert.isa() == request.param
    return str(request.param)


def _threads(threads: int, fn: Callable[[], T]) -> T:
    """fn() at `threads` torch threads (the kernels' OpenMP team)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# k: below one vector, whole vectors, a tail, past the AVX2 block's 1 KiB chunks (256 fp32 / 512 bf16),
# rows 2 / 4 KiB long (copied where they keep out of the weight's L1 sets: cpu_expert.c's `placed`)
@pytest.mark.parametrize("n_in", [5, 48, 67, 1100, 1024])
def test_linear_rows_every_row_count(isa: str, dtype: torch.dtype, n_in: int) -> None:
    """Rows 1..MAX_ROWS against float64; 1 and 2 threads give the same bits; a row gets the same
    bits alone as among others (the sums' order depends on neither)."""
    generator = torch.Generator().manual_seed(n_in)
    n_out = 37  # not a multiple of any block's rows
    weight = _tensor(generator, n_out, n_in, scale=n_in**-0.5).to(dtype)
    bias = _tensor(generator, n_out).to(dtype)
    x = _tensor(generator, cpu_expert.MAX_ROWS, n_in).to(dtype)
    alone = [cpu_expert.linear_rows(x[i : i + 1], weight, bias) for i in range(x.shape[0])]
    for rows in range(1, cpu_expert.MAX_ROWS + 1):
        assert cpu_expert.fits(x[:rows], weight, bias)
        out = _threads(1, lambda rows=rows: cpu_expert.linear_rows(x[:rows], weight, bias))
        exact = F.linear(x[:rows].double(), weight.double(), bias.double())
        assert out.dtype == dtype and rel_err(out, exact) <= TOLERANCE[dtype], rows
        assert torch.equal(out, _threads(2, lambda rows=rows: cpu_expert.linear_rows(x[:rows], weight, bias)))
        assert torch.equal(out[-1:], alone[rows - 1])


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter"), [(40, 24), (64, 600), (1100, 37), (1024, 24), (64, 1024)])
def test_ffn_group_every_isa(isa: str, dtype: torch.dtype, hidden: int, inter: int) -> None:
    """A group of experts of 1..MAX_ROWS rows: each within tolerance of float64, the same bits at 1,
    2 and 3 threads (whose spans of the experts' blocks, shares.h, split them otherwise) and alone as
    in the group (bf16: the activation stays fp32 between the two projections, in the AVX2 block's
    column order)."""
    generator = torch.Generator().manual_seed(hidden + inter)
    moe = _moe("silu")
    counts = [1, 2, 3, 9, cpu_expert.MAX_ROWS]
    ffns = [_ffn(generator, hidden, inter, dtype, bias=i % 2 == 0) for i in range(len(counts))]
    xs = [_tensor(generator, n, hidden).to(dtype) for n in counts]
    assert all(cpu_expert.fits_ffn(x, ffn) for x, ffn in zip(xs, ffns, strict=True))
    grouped = _threads(1, lambda: cpu_expert.swiglu_group(xs, ffns, moe))
    for threads in (2, 3):
        wider = _threads(threads, lambda: cpu_expert.swiglu_group(xs, ffns, moe))
        assert all(torch.equal(a, b) for a, b in zip(grouped, wider, strict=True))
    for x, ffn, out in zip(xs, ffns, grouped, strict=True):
        assert torch.equal(out, cpu_expert.swiglu_group([x], [ffn], moe)[0])
        assert torch.equal(out[-1:], cpu_expert.swiglu_group([x[-1:]], [ffn], moe)[0])
        if dtype == torch.bfloat16:
            assert rel_err(out, _reference(x, ffn, moe)) <= TOLERANCE[dtype]
        else:
            assert _error(out, x, ffn, moe) <= TOLERANCE[dtype]


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter"), [(40, 24), (1100, 37), (1024, 24), (64, 1024)])
def test_routed_group_is_gather_group_and_scale(
    isa: str, dtype: torch.dtype, scale_dtype: torch.dtype, hidden: int, inter: int
) -> None:
    """swiglu_routed (the gather and the scale in the kernel's call) gives the bits of gathering the
    rows, swiglu_group and torch's product with the scales, at 1 and 2 threads; the product's dtype
    is torch's (bf16 only for bf16 experts with bf16 scales)."""
    generator = torch.Generator().manual_seed(hidden * inter)
    moe = _moe("silu")
    counts = [1, 3, 2, cpu_expert.MAX_ROWS]
    ffns = [_ffn(generator, hidden, inter, dtype, bias=i == 1) for i in range(len(counts))]
    wide = _tensor(generator, cpu_expert.MAX_ROWS + 3, hidden + 5).to(dtype)
    x = wide[:, 2 : 2 + hidden]  # [T, hidden]: rows with a stride of their own
    rows = torch.cat([torch.randperm(len(x), generator=generator)[:n] for n in counts])  # [sum n_e]
    scales = torch.rand(len(rows), generator=generator).to(scale_dtype)  # [sum n_e]
    assert cpu_expert.fits_routed(x, counts, ffns)
    routed = _threads(1, lambda: cpu_expert.swiglu_routed(x, rows, scales, counts, ffns, moe))
    grouped = cpu_expert.swiglu_group(list(x[rows].split(counts)), ffns, moe)
    expected = torch.cat(grouped) * scales[:, None]  # [sum n_e, hidden]
    assert routed.dtype == expected.dtype and torch.equal(routed, expected)
    two = _threads(2, lambda: cpu_expert.swiglu_routed(x, rows, scales, counts, ffns, moe))
    assert torch.equal(routed, two)
    assert not cpu_expert.fits_routed(x, [*counts[:-1], cpu_expert.MAX_ROWS + 1], ffns)


def test_isa_follows_the_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 F / BW / VL / BF16: the AVX-512 block; else AVX2 + FMA: the AVX2 block; else the
    portable one (compiled for the host); FLOWMOE_CPU_ISA forces any where the CPU can run it (else
    the default), and names bad values."""
    monkeypatch.delenv("FLOWMOE_CPU_ISA", raising=False)

    def _chosen() -> str:
        cpu_expert.isa.cache_clear()  # worked out once per process
        return cpu_expert.isa()

    avx2 = frozenset({"avx2", "fma"})
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    cases = {
        avx2: "avx2",
        zen4: "avx512",
        zen4 - {"avx512_bf16"}: "avx2",  # AVX-512 without BF16 (Skylake-X, Ice Lake)
        frozenset({"avx2"}): "portable",  # no FMA
        frozenset(): "portable",  # no /proc/cpuinfo
    }
    for flags, expected in cases.items():
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: flags)
        assert _chosen() == expected
    monkeypatch.setattr(native, "cpu_flags", lambda: zen4)
    for forced in ("portable", "avx2", "avx512"):
        monkeypatch.setenv("FLOWMOE_CPU_ISA", forced)
        assert _chosen() == forced
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert _chosen() == "portable"  # never an instruction the CPU lacks
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2)
    assert _chosen() == "avx2"  # FLOWMOE_CPU_ISA=avx512 on an AVX2 CPU: its default
    monkeypatch.setenv("FLOWMOE_CPU_ISA", "portable")
    assert _chosen() == "portable"
    monkeypatch.setenv("FLOWMOE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="FLOWMOE_CPU_ISA='avx9'"):
        _chosen()


@compiled
def test_blocks_agree_within_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable block (the fallback where the CPU lacks AVX2 / FMA), the AVX2 and the AVX-512
    blocks compute the same projection; only the order of the fp32 sums differs."""
    if len(ISAS) < 2:
        pytest.skip("this CPU runs only the portable block")
    generator = torch.Generator().manual_seed(11)
    weight = _tensor(generator, 50, 300, scale=300**-0.5).bfloat16()
    x = _tensor(generator, 5, 300).bfloat16()
    monkeypatch.setattr(cpu_expert, "max_rows", lambda dtype: cpu_expert.MAX_ROWS)
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for name in ISAS:
            monkeypatch.setenv("FLOWMOE_CPU_ISA", name)
            cpu_expert.isa.cache_clear()
            outs.append(cpu_expert.linear_rows(x.to(dtype), weight.to(dtype)))
        assert all(rel_err(outs[0], out) <= TOLERANCE[dtype] / 3 for out in outs[1:])  # one rounding apart


@pytest.mark.parametrize("rows", [experts.WIDEN_ROWS, cpu_expert.AVX2_MAX_ROWS + 3, FEW_ROWS, FEW_ROWS + 5])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_slabs_give_linears_floats(
    rows: int, threads: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 expert of many rows projected a slab of weight rows at a time (where torch's bf16 is
    emulated and linear widens the weight to fp32) gives linear's floats and layout bit for bit, on
    either side of FEW_ROWS (linear's two forms) and at any thread count: the prefill's expert FFN,
    and so its tokens, as before its weights were widened whole."""
    generator = torch.Generator().manual_seed(rows)
    moe, hidden, inter = _moe("silu"), 64, 96
    monkeypatch.setattr(experts, "SLAB_BYTES", 40 * hidden * 4)  # slabs of 40 rows, the last one shorter
    ffn = _ffn(generator, hidden, inter, torch.bfloat16, bias)
    x = _tensor(generator, rows, hidden).bfloat16()
    whole = _threads(threads, lambda: linear(x, ffn[0], ffn[2]))
    slabs = _threads(threads, lambda: experts._widened_in_slabs(x, ffn[0], ffn[2]))
    assert torch.equal(slabs, whole) and slabs.stride() == whole.stride()
    gate, up = whole.chunk(2, dim=-1)
    expected = linear(F.silu(gate) * up, ffn[1], ffn[3])  # the FFN composed without slabs
    assert torch.equal(_threads(threads, lambda: swiglu_ffn_torch(x, ffn, moe)), expected)
