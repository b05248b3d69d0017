"""The int4 Triton kernel (kernels/int4_triton.py) under Triton's interpreter (TRITON_INTERPRET=1) on
CPU tensors: the torch path's bits (model/quantized.py, `Int4Weight._rows`) and an independent numpy
unpacking's, in bfloat16, float16 and float32, ragged groups and odd columns, into a row block of a
larger buffer; the dispatch (the kernel under the interpreter or on CUDA, torch otherwise); a
scheduler whose device dequantizes every expert with it giving eager's tokens; its sm_90 build
(compiled here, no GPU needed); and, where CUDA is visible, the compiled kernel's bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flowmoe.core.policy import Policy
from flowmoe.devices.factory import make_workers
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.quantize import hqq, quantize_int4
from flowmoe.model.quantized import Int4Weight, in_row_blocks
from flowmoe.runtime.device_weights import Devices
from flowmoe.runtime.pinned import pin_layers
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_through
from tests.test_grouped_experts import torch_ops_only  # noqa: F401  # a fixture, used by name

triton = pytest.importorskip(
    "triton",
    reason="triton is not installed (pip install -e '.[test]' brings it on Linux x86-64; CUDA builds of "
    "torch bring their own): the int4 Triton kernel is checked under its interpreter",
)
from flowmoe.kernels import int4_triton  # noqa: E402  # needs triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _random(rows: int, cols: int, group: int, seed: int) -> Int4Weight:
    """Any bytes, and any float16 scales and zeros of either sign (round-to-even ties included)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-cols // group)
    packed = torch.randint(0, 256, (rows, -(-cols // 2)), dtype=torch.uint8, generator=g)
    scale = (torch.randn(rows, groups, generator=g) * 0.05).half()
    zero = (torch.randn(rows, groups, generator=g) * 4 + 8).half()
    return Int4Weight(packed, scale, zero, group, cols)


def _torch_path(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:  # -> [R, C]
    out = torch.empty(weight.shape, dtype=dtype)
    in_row_blocks(out, weight._rows)
    return out


def _numpy(weight: Int4Weight) -> np.ndarray:
    """[R, C] float32: the nibbles unpacked by numpy (column 2j low, 2j + 1 high), (q - zero) x scale."""
    packed = weight.packed.numpy()
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)[:, : weight.columns]
    spread = [
        np.repeat(t.float().numpy(), weight.group, axis=1)[:, : weight.columns]
        for t in (weight.zero, weight.scale)
    ]
    return (q.astype(np.float32) - spread[0]) * spread[1]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "cols", "group"),
    [(37, 1000, 128), (64, 256, 64), (5, 129, 128), (3, 1, 128), (40, 2048, 128)],
)
def test_the_kernel_gives_the_torch_paths_bits_and_numpys(
    dtype: torch.dtype, rows: int, cols: int, group: int
) -> None:
    for weight in (_random(rows, cols, group, seed=rows), quantize_int4(torch.randn(rows, cols), group, hqq)):
        out = torch.empty(rows, cols, dtype=dtype)
        int4_triton.dequantize(weight.packed, weight.scale, weight.zero, group, out)
        assert _same_bits(out, _torch_path(weight, dtype))
        assert _same_bits(out, torch.from_numpy(_numpy(weight)).to(dtype))


@pytest.mark.usefixtures("interpreted")
def test_the_kernel_writes_its_rows_of_a_larger_buffer_and_nothing_else() -> None:
    weight = _random(24, 300, 128, seed=3)
    buffer = torch.full((40, 300), 7.0, dtype=torch.bfloat16)  # [40, 300]: rows 10..33 are the weight's
    int4_triton.dequantize(weight.packed, weight.scale, weight.zero, 128, buffer[10:34])
    assert _same_bits(buffer[10:34], _torch_path(weight, torch.bfloat16))
    assert (buffer[:10] == 7).all() and (buffer[34:] == 7).all()


def test_the_kernel_runs_under_the_interpreter_or_on_cuda_and_torch_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = _random(16, 256, 128, seed=5)
    calls: list[torch.Tensor] = []
    monkeypatch.setattr(int4_triton, "dequantize", lambda *args: calls.append(args[-1]))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = weight.dequantize(torch.bfloat16)  # the CPU: torch
    assert not calls and _same_bits(reference, _torch_path(weight, torch.bfloat16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weight.dequantize(torch.bfloat16)
    assert len(calls) == 1 and calls[0].shape == (16, 256)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel is checked on a GPU run"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_kernel_on_cuda_gives_the_torch_paths_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under the interpreter: a CUDA weight's dequantization is the kernel's, equal to the torch
    path's on the host ((q - zero) x scale has no multiply-add to fuse, and from float16 operands no
    float32 subnormal to flush)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for weight in (_random(1024, 4096, 128, seed=7), _random(4096, 1000, 64, seed=8)):
        on_gpu = weight.rebuilt(iter([t.cuda() for t in weight.tensors()]))
        assert _same_bits(on_gpu.dequantize(dtype).cpu(), _torch_path(weight, dtype))


@pytest.mark.parametrize(("out", "bf16"), [("*u16", True), ("*fp16", False), ("*fp32", False)])
def test_the_kernel_compiles_for_an_h200_with_no_multiply_add_and_no_flush(out: str, bf16: bool) -> None:
    """Compiled for sm_90 here (triton's own ptxas, no GPU needed), as the launch compiles it: its PTX
    fuses no multiply-add and flushes no subnormal, so a GPU rounds as the interpreter and torch do."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = {"GROUP": 128, "BF16": bf16, "BLOCK_R": 4, "BLOCK_C": 1024}
    pointers = {"packed": "*u8", "scale": "*fp16", "zero": "*fp16", "out": out}
    integers = dict.fromkeys(["rows", "columns", "packed_row", "group_row", "out_row"], "i32")
    signature = pointers | integers | dict.fromkeys(constants, "constexpr")  # the kernel's order
    source = ASTSource(int4_triton._kernel(False), signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and compiled.asm["cubin"]
    assert "fma." not in ptx and ".ftz" not in ptx


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> object:
    folder: Path = save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("int4-triton") / "mixtral")
    model = load_model(folder, packing=Packing("int4"))
    pin_layers(model, register=lambda arena: None)
    return model


@pytest.mark.usefixtures("torch_ops_only")  # eager's experts dequantized by torch, then torch's GEMMs
def test_a_scheduler_dequantizing_with_the_kernel_gives_eagers_tokens(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cgopipe with its int4 experts copied packed to another device (cpu:0) and dequantized there by
    the kernel (interpreted) at their first use; eager dequantizes in torch on the host."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (reference, _) = run_eager(model)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = int4_triton.dequantize
    calls = []
    monkeypatch.setattr(int4_triton, "dequantize", lambda *args: (calls.append(1), kernel(*args)))
    devices = Devices(torch.device("cpu", 0))
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5, expert_format="int4")
    (results, _) = run_through(model, "cgopipe", policy, devices, *make_workers(devices.gpu))
    assert calls  # gate, up and down of each expert dequantized on the "GPU"
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
