"""A layer's routed experts in one grouped GEMM per projection (kernels/grouped_experts.py): the
per-expert path's floats (fp32 within 1e-5 relative, bf16 within its rounding), experts with no
rows, uneven and single ones, the cases it leaves to the per-expert path, and a constant number of
torch operations whatever the number of experts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert, grouped_experts, native
from flowmoe.kernels.cpu_expert import FFN
from flowmoe.kernels.experts import swiglu_ffn_gathered, swiglu_ffn_torch
from flowmoe.kernels.grouped_experts import stacked, swiglu_grouped

HIDDEN, INTER, EXPERTS = 64, 48, 8
MOE = MoESpec(experts=EXPERTS, top_k=2, intermediate=INTER)


def _arena(dtype: torch.dtype, gap: int = 16) -> list[FFN]:
    """EXPERTS experts' (gate_up, down) laid out one after the other in one buffer, `gap` elements
    apart, as a layer's arena holds them, after other tensors' bytes (so that a stride's first
    slot before the first expert is a gate_up's but a down's)."""
    generator = torch.Generator().manual_seed(3)
    sizes = (2 * INTER * HIDDEN, HIDDEN * INTER)
    stride = sum(sizes) + 2 * gap
    lead = stride - sizes[0] // 2
    flat = (torch.randn(lead + EXPERTS * stride, generator=generator) * 0.2).to(dtype)
    ffns: list[FFN] = []
    for e in range(EXPERTS):
        start = lead + e * stride
        gate_up = flat[start : start + sizes[0]].view(2 * INTER, HIDDEN)
        down = flat[start + sizes[0] + gap : start + sizes[0] + gap + sizes[1]].view(HIDDEN, INTER)
        gate_up.arena = down.arena = flat  # type: ignore[attr-defined]  # as model/arena.py marks its views
        ffns.append((gate_up, down, None, None))
    return ffns


def _rows(counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)


def _per_expert(x: torch.Tensor, counts: list[int], ffns: list[FFN]) -> torch.Tensor:
    return torch.cat([swiglu_ffn_torch(rows, f, MOE) for rows, f in zip(x.split(counts), ffns, strict=True)])


@pytest.fixture
def torch_ops_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C kernels off: their few fp32 rows would come first (kernels/experts.py)."""
    monkeypatch.setenv("FLOWMOE_CPU_KERNELS", "0")
    native.library.cache_clear()
    cpu_expert.library.cache_clear()
    yield
    monkeypatch.undo()
    native.library.cache_clear()
    cpu_expert.library.cache_clear()


@pytest.mark.usefixtures("torch_ops_only")  # the reference: torch's per-expert path
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(
    ("experts", "counts"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7], [3, 1, 7, 2, 5, 1, 4, 9]),  # every expert, uneven
        ([1, 4, 6], [2, 0, 5]),  # a subset (the experts between get no rows), one with none
        ([2, 3], [1, 1]),
    ],
)
def test_grouped_gives_the_per_expert_floats(
    dtype: torch.dtype, tolerance: float, experts: list[int], counts: list[int]
) -> None:
    arena = _arena(dtype)
    ffns = [arena[e] for e in experts]
    x = _rows(counts, dtype)
    grouped = swiglu_grouped(x, counts, ffns, MOE)
    assert grouped is not None
    reference = _per_expert(x, counts, ffns)
    assert grouped.shape == reference.shape == (sum(counts), HIDDEN)
    torch.testing.assert_close(grouped.float(), reference.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("torch_ops_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cudas_form_gives_the_same_floats(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The x @ W.T form CUDA takes, run on the CPU's grouped GEMM."""
    monkeypatch.setattr(grouped_experts, "_rows_as_columns", grouped_experts._rows_as_rows)
    counts = [4, 0, 2, 6, 1, 3, 2, 5]
    ffns = _arena(dtype)
    x = _rows(counts, dtype)
    out = swiglu_grouped(x, counts, ffns, MOE)
    assert out is not None and out.is_contiguous()  # x @ W.T's rows, not W @ x.T's columns
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    reference = _per_expert(x, counts, ffns)
    torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_stacked_views_in_place() -> None:
    ffns = _arena(torch.float32)
    view = stacked([ffns[e][0] for e in (1, 3, 7)])
    assert view is not None
    tensor, slots = view
    assert slots == [0, 1, 3] and tensor.shape == (4, 2 * INTER, HIDDEN)  # every 2nd expert from 1 on
    assert tensor.data_ptr() == ffns[1][0].data_ptr()  # a view, no copy
    assert torch.equal(tensor[1], ffns[3][0]) and torch.equal(tensor[3], ffns[7][0])
    again = stacked([ffns[e][0] for e in (3, 5)])  # another group at that stride: the same view
    assert again is not None and again[0] is tensor and again[1] == [1, 2]
    down = stacked([ffns[e][1] for e in (0, 1)])  # a slot of other bytes before the first down
    assert down is not None and down[1] == [1, 2] and torch.equal(down[0][7], ffns[6][1])
    separate = [torch.randn(2 * INTER, HIDDEN) for _ in range(2)]  # two buffers: no common view
    assert stacked(separate) is None
    assert stacked([ffns[3][0], ffns[1][0]]) is None  # not ascending


Case = tuple[str, list[FFN], MoESpec, list[int], torch.dtype]


def _fallback_cases() -> Iterator[Case]:
    ffns, counts = _arena(torch.float32), [2] * EXPERTS
    bias = torch.zeros(2 * INTER)
    yield "one expert", ffns[:1], MOE, [2], torch.float32
    yield "biases", [(g, d, bias, None) for g, d, _, _ in ffns], MOE, counts, torch.float32
    yield "clamped", ffns, attrs.evolve(MOE, activation="clamped_swiglu"), counts, torch.float32
    separate: list[FFN] = [(g.clone(), d.clone(), None, None) for g, d, _, _ in ffns]
    yield "separate buffers", separate, MOE, counts, torch.float32
    yield "fp16", _arena(torch.float16), MOE, counts, torch.float16
    yield "too many rows", ffns[:2], MOE, [300, 1], torch.float32
    yield "rows past a tile, not whole tiles", ffns[:2], MOE, [17, 1], torch.float32  # linear's x @ W.T


@pytest.mark.parametrize("case", list(_fallback_cases()), ids=lambda case: case[0])
def test_what_it_does_not_take_goes_the_per_expert_way(case: Case) -> None:
    _, ffns, moe, counts, dtype = case
    assert swiglu_grouped(_rows(counts, dtype), counts, ffns, moe) is None


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWMOE_GROUPED_EXPERTS", "0")
    assert swiglu_grouped(_rows([1, 1], torch.float32), [1, 1], _arena(torch.float32)[:2], MOE) is None


def test_the_cpu_kernels_come_first() -> None:
    """Few fp32 rows on the CPU go to cpu_expert.c where it is built (not grouped)."""
    if cpu_expert.library() is None:
        pytest.skip("the C kernels are not built here")
    counts = [2, 3]
    assert swiglu_ffn_gathered(_rows(counts, torch.float32), counts, _arena(torch.float32)[:2], MOE) is None


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("torch_ops_only")
def test_one_launch_per_projection_whatever_the_experts() -> None:
    """9 operations (2 of them the grouped GEMMs, 3 views) for 2, 5 or 8 experts of a layer's buffer."""
    arena, counted = _arena(torch.float32), []
    for experts in (2, 5, 8):
        counts = [3] * experts
        x = _rows(counts, torch.float32)
        swiglu_ffn_gathered(x, counts, arena[:experts], MOE)  # the layer's views made, once
        with torch.inference_mode(), _Ops() as ops:
            assert swiglu_ffn_gathered(x, counts, arena[:experts], MOE) is not None
        counted.append(ops.ops)
    assert counted[0]["_grouped_mm"] == 2 and "mm" not in counted[0]
    assert [sum(ops.values()) for ops in counted] == [9, 9, 9], counted
