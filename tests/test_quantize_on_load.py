"""Quantize-on-load a layer at a time (model/loading.py, `Packing`): the same packed values, bit for
bit, as loading the whole model and packing it after; each layer's weights in the model's dtype let
go before the next layer is read; the error report's reference, read again a layer at a time, equal
to the unquantized model's logits; progress per layer; refusals before any weight is read."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from flowmoe.core.errors import ConfigError
from flowmoe.core.policy import QUANTIZED_ON_LOAD
from flowmoe.model import loading, quantize
from flowmoe.model.arena import Slot, arena_of, layer_slots
from flowmoe.model.loading import Packing, layer_packer, load_model, opened
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quant_error import last_logits, measured, reference_logits
from flowmoe.model.quantize import quantize_int4, quantize_int8, quantize_weight
from flowmoe.model.weights import LayerWeights
from tests.hf_models import hf_model, save_hf
from tests.test_fp8 import write_pair

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def tensors(slots: list[Slot]) -> list[torch.Tensor]:
    """A layer's tensors, packed experts and attention included, in its arena's order."""
    return [t for _, _, t in slots if t is not None]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("on-load")
    folders = {family: save_hf(hf_model(family), root / family) for family in ("mixtral", "deepseek_v3")}
    folders["bf16"] = save_hf(hf_model("mixtral", torch.bfloat16), root / "bf16")
    write_pair(hf_model("mixtral"), root / "fp8", root / "fp8-ref")
    folders["fp8"] = root / "fp8"
    return folders


def _assert_same(ours: MoEModel, theirs: MoEModel) -> None:
    for a, b in zip(ours.weights.layers, theirs.weights.layers, strict=True):
        assert [type(w) for x in a.packed for w in x.weights()] == [
            type(w) for x in b.packed for w in x.weights()
        ]
        left, right = (tensors(layer_slots(lw)) for lw in (a, b))
        assert len(left) == len(right)
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(left, right, strict=True))
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(getattr(ours.weights, name), getattr(theirs.weights, name))


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_row_blocks_quantize_to_the_whole_projections_values(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.setattr(quantize, "BLOCK_WEIGHTS", 3000)  # 10 rows of 300 columns a block, the last 5
    weight = torch.randn(
        95, 300, generator=torch.Generator().manual_seed(0)
    ).bfloat16()  # groups: 128, 128, 44
    whole = quantize_int8(weight) if form == "int8" else quantize_int4(weight, 128)
    blocked = quantize_weight(weight, form)  # type: ignore[arg-type]
    assert type(blocked) is type(whole) and blocked.shape == whole.shape
    assert all(torch.equal(a, b) for a, b in zip(blocked.tensors(), whole.tensors(), strict=True))


CASES = [
    *((family, Packing(form)) for family in ("mixtral", "deepseek_v3") for form in QUANTIZED_ON_LOAD),
    ("bf16", Packing("int4")),
    ("mixtral", Packing("int8", "hqq4")),
    ("mixtral", Packing("native", "int4")),
    ("fp8", Packing("fp8")),
]


@pytest.mark.parametrize(("family", "packing"), CASES, ids=lambda c: getattr(c, "expert_format", c))
def test_packed_as_read_equals_packed_after_the_whole_load(folders, family: str, packing: Packing) -> None:
    folder = folders[family]
    after = load_model(folder)  # every layer held in the model's dtype, then each packed
    with opened(folder, after.spec) as tensors:
        pack = layer_packer(folder, tensors, after.spec, packing)
        for layer, lw in enumerate(after.weights.layers):
            pack(layer, lw)
    _assert_same(load_model(folder, packing=packing), after)


def test_each_layer_in_the_models_dtype_is_let_go_before_the_next_is_read(
    folders, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = loading.read_layer
    unpacked: list[weakref.ref] = []  # the buffer each MoE layer was read into

    def reading(source, spec, layer: int) -> LayerWeights:
        assert all(buffer() is None for buffer in unpacked)  # every layer before is held packed only
        lw = read(source, spec, layer)
        if lw.router is not None:
            unpacked.append(weakref.ref(arena_of(lw)))
        return lw

    monkeypatch.setattr(loading, "read_layer", reading)
    done: list[tuple[int, int]] = []
    model = load_model(folders["deepseek_v3"], progress=lambda *d: done.append(d), packing=Packing("int4"))
    assert done == [(layer + 1, model.spec.layers) for layer in range(model.spec.layers)]
    assert len(unpacked) == model.spec.layers - 1 and all(buffer() is None for buffer in unpacked)


def test_the_reference_read_a_layer_at_a_time_is_the_unquantized_models(folders) -> None:
    for family in ("mixtral", "deepseek_v3"):
        folder = folders[family]
        plain = last_logits(load_model(folder), PROMPTS)
        quantized = load_model(folder, packing=Packing("hqq4"))
        assert torch.equal(reference_logits(quantized, folder, PROMPTS), plain)
        assert not any(lw.experts for lw in quantized.weights.layers if lw.router is not None)  # left packed


def test_the_error_measured_is_the_one_packing_after_the_load_measured(folders) -> None:
    folder = folders["mixtral"]
    plain = last_logits(load_model(folder), PROMPTS)
    for packing in (Packing("int4"), Packing("int8", "int8")):
        model = load_model(folder, packing=packing)
        error = measured(model, folder, packing, PROMPTS)
        rel = (last_logits(model, PROMPTS) - plain).norm(dim=-1) / plain.norm(dim=-1)  # [B]
        assert error is not None and error.prompts == 2 and error.attention_format == packing.attention_format
        assert (error.max_rel, error.mean_rel) == (float(rel.max()), float(rel.mean()))
    assert measured(load_model(folder), folder, Packing(), PROMPTS) is None
    assert measured(load_model(folder, packing=Packing("int4")), folder, Packing("int4"), []) is None


@pytest.mark.parametrize(
    ("family", "packing", "message"),
    [
        ("fp8", Packing("int4"), "is an FP8 checkpoint: run it with --expert-format fp8"),
        ("mixtral", Packing("fp8"), 'has no quantization_config of quant_method "fp8"'),
        ("fp8", Packing("native", "int8"), "is stored quantized already: leave --attention-format out"),
        ("deepseek_v3", Packing("int4", "int4"), "multi-head latent attention"),
    ],
)
def test_a_format_the_source_cannot_take_is_refused_before_any_layer_is_read(
    folders, monkeypatch: pytest.MonkeyPatch, family: str, packing: Packing, message: str
) -> None:
    monkeypatch.setattr(loading, "read_layer", lambda *_: pytest.fail("a layer was read"))
    with pytest.raises(ConfigError, match=message):
        load_model(folders[family], packing=packing)
    with pytest.raises(ConfigError, match="needs an FP8 checkpoint folder"):
        load_model("mixtral-8x7b", layers=1, packing=Packing("fp8"))
