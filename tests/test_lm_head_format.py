"""--lm-head-format: the LM head quantized on load, kept packed for the CPU's packed kernel and
dequantized in place for a GPU, the error a run reports, and refusals (every scheduler giving
eager's tokens on it: tests/test_attention_format.py, whose model quantizes its head too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from attrs import evolve

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.kernels import cpu_packed
from flowmoe.kernels.norm import norm_of_kind
from flowmoe.model.loading import Packing, head_packer, load_model
from flowmoe.model.quant_error import last_logits, measured
from flowmoe.model.quantize import quantize_weight
from flowmoe.model.quantized import packed_linear
from flowmoe.model.random_weights import RandomSource
from tests.hf_models import hf_model, save_hf

pytestmark = pytest.mark.skipif(cpu_packed.linear_kernel() is None, reason="no C compiler here")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_head")
    return {family: save_hf(hf_model(family), root / family) for family in ("mixtral", "phimoe")}


@pytest.mark.parametrize("form", ["int8", "int4", "hqq4"])
@pytest.mark.parametrize("family", ["mixtral", "phimoe"])  # phimoe: a bias column
def test_the_head_is_kept_packed_and_run_by_the_kernel(folders, family: str, form: str) -> None:
    plain = load_model(folders[family])
    model = load_model(folders[family], packing=Packing(lm_head_format=form))  # type: ignore[arg-type]
    packed = model.weights.lm_head_packed
    assert packed is not None
    bias = model.spec.lm_head_bias
    head = model.weights.lm_head[:, :-1] if bias else model.weights.lm_head  # [vocab, hidden]
    original = plain.weights.lm_head[:, :-1] if bias else plain.weights.lm_head
    assert torch.equal(head, quantize_weight(original, form).dequantize(head.dtype))  # type: ignore[arg-type]
    if bias:
        assert torch.equal(model.weights.lm_head[:, -1], plain.weights.lm_head[:, -1])
    hidden = torch.randn(3, model.spec.hidden, generator=torch.Generator().manual_seed(0))  # [B, hidden]
    x = norm_of_kind(hidden, model.weights.final_norm, model.spec.norm_eps, model.spec.norm)
    expected = packed_linear(x, packed, model.weights.lm_head[:, -1] if bias else None)  # [B, vocab]
    assert expected is not None
    assert torch.equal(model.logits(hidden), expected.float())
    copy = model.weights.lm_head.clone()  # as a runtime's copy of the head: the host's packed head still
    assert torch.equal(model.logits(hidden, head=copy), expected.float())


def test_the_error_is_measured_against_the_head_as_stored(folders) -> None:
    folder = folders["mixtral"]
    plain = last_logits(load_model(folder), PROMPTS)
    packing = Packing(lm_head_format="int4")
    model = load_model(folder, packing=packing)
    error = measured(model, folder, packing, PROMPTS)
    rel = (last_logits(model, PROMPTS) - plain).norm(dim=-1) / plain.norm(dim=-1)  # [B]
    assert error is not None and error.lm_head_format == "int4" and error.max_rel is not None
    assert error.max_rel == pytest.approx(float(rel.max()), rel=1e-5) and error.max_rel > 0
    assert "the LM head quantized to int4" in error.quantized
    assert model.weights.lm_head_packed is not None  # the measurement left the model as loaded


def test_a_run_reports_it_and_bad_uses_are_one_line(
    folders, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n')
    run = ["run", "--model", str(folders["mixtral"]), "--prompts", str(prompts), "-n", "2", "--greedy"]
    assert main([*run, "--output", str(tmp_path / "o.jsonl"), "--json", "--lm-head-format", "int8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantization"]
    assert (report["lm_head_format"], report["attention_format"]) == ("int8", "native")
    assert 0 < report["logits_rel_err_max"] < 0.5
    code = main([*run, "--output", str(tmp_path / "r.jsonl"), "--lm-head-format", "int4", "--ray", "local"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flowmoe: error")]
    assert code == 2 and len(errors) == 1 and "--ray's replicas" in errors[0]
    spec = evolve(load_model(folders["mixtral"]).spec, tie_embeddings=True)
    with pytest.raises(ConfigError, match="tied"):
        head_packer("tied", RandomSource(spec), spec, Packing(lm_head_format="int4"))
