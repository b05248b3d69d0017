"""kernels.linear: the CPU's fast GEMM forms compute what F.linear computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flowmoe.kernels import cpu_expert
from flowmoe.kernels import linear as kernel
from tests.helpers import rel_err


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 48, 250, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_f_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    b = torch.randn(200, generator=generator) if bias else None
    out = kernel.linear(x, weight, b)
    assert out.shape == (rows, 200)
    assert rel_err(out, F.linear(x, weight, b)) < 1e-6
    # an input that is itself a transposed view (what an elementwise op on a few-row output gives)
    assert rel_err(kernel.linear(x.t().contiguous().t(), weight, b), F.linear(x, weight, b)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [4, 64])
def test_half_precision_rounds_like_f_linear(dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    weight = (torch.randn(64, 128, generator=generator) * 0.1).to(dtype)
    b = torch.randn(64, generator=generator).to(dtype)
    out = kernel.linear(x, weight, b)
    exact = F.linear(x.double(), weight.double(), b.double())
    assert out.dtype == dtype
    # both accumulate in fp32 and round the product once: within an ulp or two of the exact product
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert rel_err(out, exact) <= 3 * ulp
    assert rel_err(out, F.linear(x, weight, b)) <= 3 * ulp


def test_widening_only_where_half_precision_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    real = F.linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.dtype)
        return real(x, weight, bias)

    def spy_matmul(weight: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:  # the few-row form
        calls.append(x_t.dtype)
        return real_matmul(weight, x_t)

    real_matmul = torch.matmul
    monkeypatch.setattr(kernel.F, "linear", spy)
    monkeypatch.setattr(kernel.torch, "matmul", spy_matmul)
    x, weight = torch.randn(300, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    kernel.linear(x, weight)  # widened, the fp32 product of 300 rows is F.linear's
    assert calls == ([torch.float32] if kernel._emulated(torch.bfloat16) else [torch.bfloat16])
    calls.clear()
    kernel.linear(x[:4], weight)  # a few rows: widening the weight would cost more than it saves
    assert calls == ([] if cpu_expert.fits(x[:4], weight) else [torch.bfloat16])  # or the C kernels


@pytest.mark.parametrize("emulated", [False, True])
def test_few_bf16_rows_take_the_cpu_kernels_or_onednn(
    monkeypatch: pytest.MonkeyPatch, emulated: bool
) -> None:
    """bf16 at 8 rows: cpu_expert's kernels where torch has no native bf16 matmul or the kernels
    run their AVX2 or AVX-512 block, oneDNN (the transposed matmul) where torch has native bf16 and
    the kernels their portable block; either way F.linear's product within a rounding."""
    if cpu_expert.library() is None:
        pytest.skip("no C compiler for the CPU kernels here")
    monkeypatch.setattr(cpu_expert, "emulated", lambda dtype: emulated and dtype == torch.bfloat16)
    taken: list[int] = []
    real = cpu_expert.linear_rows

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        taken.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(cpu_expert, "linear_rows", spy)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8, 96, generator=generator).bfloat16()
    weight = (torch.randn(40, 96, generator=generator) * 0.1).bfloat16()
    out = kernel.linear(x, weight)
    assert taken == ([8] if emulated or cpu_expert.isa() != "portable" else [])
    assert rel_err(out, F.linear(x.double(), weight.double())) <= 3 * 2**-8


def test_past_a_tile_the_transposed_form_in_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past TILE_ROWS rows (W @ x.T).T only in whole tiles of the GEMM's columns, else x @ W.T (a
    row-major output); the CPU kernels kept out, so the choice is torch's forms alone."""
    monkeypatch.setattr(cpu_expert, "fits", lambda *_, **__: False)
    assert [kernel.rows_as_columns(n) for n in (1, 16, 17, 31, 32, 48, 250, 256, 272)] == [
        True, True, False, False, True, True, False, True, False
    ]  # fmt: skip
    weight = torch.randn(40, 24)
    for rows in (17, 32, 48, 250, 256):
        out = kernel.linear(torch.randn(rows, 24), weight)
        assert out.is_contiguous() != kernel.rows_as_columns(rows)  # the transposed form: a transposed view


def test_bf16_rows_padded_to_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 with native matmuls, past TILE_ROWS rows: oneDNN sees only multiples of PAD_ROWS rows
    (zero rows added, their products dropped), so that the primitives it makes and keeps per shape
    stay a few per weight (a prefill's experts get any count of rows: a process grew by ~2 MB a
    prompt without it), in the transposed form where they are whole tiles; the rows' products
    F.linear's within a rounding."""
    if kernel._emulated(torch.bfloat16):
        pytest.skip("torch emulates bf16 matmuls here: they are widened to fp32")
    monkeypatch.setattr(cpu_expert, "fits", lambda *_, **__: False)
    seen: list[tuple[str, int]] = []
    real_matmul, real_linear = torch.matmul, F.linear

    def spy_matmul(weight: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
        seen.append(("transposed", x_t.shape[1]))
        return real_matmul(weight, x_t)

    def spy_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(("rows", x.shape[0]))
        return real_linear(x, weight, bias)

    monkeypatch.setattr(kernel.torch, "matmul", spy_matmul)
    monkeypatch.setattr(kernel.F, "linear", spy_linear)
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(40, 96, generator=generator) * 0.1).bfloat16()
    for rows, form, taken in ((17, "rows", 24), (31, "transposed", 32), (33, "rows", 40), (100, "rows", 104),
                              (250, "transposed", 256)):  # fmt: skip
        x = torch.randn(rows, 96, generator=generator).bfloat16()
        out = kernel.linear(x, weight)
        assert out.shape == (rows, 40) and seen[-1] == (form, taken)
        assert rel_err(out, F.linear(x.double(), weight.double())) <= 3 * 2**-8
    kernel.linear(torch.randn(300, 96).bfloat16(), weight)  # past FEW_ROWS: F.linear, unpadded
    assert seen[-1] == ("rows", 300)


@pytest.mark.parametrize("given", [None, "5"])
def test_ideep_cache_capped_unless_the_user_chose(given: str | None) -> None:
    """LRU_CACHE_CAPACITY (ideep's cache of oneDNN computations, read at its first use) is IDEEP_CACHE
    once the module is imported, or what the user set."""
    env = {k: v for k, v in os.environ.items() if k != "LRU_CACHE_CAPACITY"}
    if given is not None:
        env["LRU_CACHE_CAPACITY"] = given
    code = "import os, flowmoe.kernels.linear; print(os.environ['LRU_CACHE_CAPACITY'])"
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == (given or str(kernel.IDEEP_CACHE))
