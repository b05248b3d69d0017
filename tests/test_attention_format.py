"""--attention-format (Klotski(q): attention tensors quantized as the experts are): the cost model's
packed attention bytes, the in-place quantization of q/k/v and o on load, every scheduler giving
eager's tokens on the quantized model, the error a run reports and records, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.expert_formats import attention_bytes, dense_layer_bytes
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.scheduling import NodeFactory
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quant_error import last_logits, measured
from flowmoe.model.quantize import quantize_layer_attention, quantize_weight
from flowmoe.schedulers.registry import available
from tests.helpers import rel_err
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_scheduler

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("attention")
    return {family: save_hf(hf_model(family), root / family) for family in ("mixtral", "deepseek_v3")}


def test_the_cost_model_prices_packed_attention_on_the_dense_parts_copies() -> None:
    spec = preset("mixtral-8x7b", layers=2, dtype="bfloat16")
    weights = spec.hidden * (2 * spec.attention.q_width + 2 * spec.attention.kv_width)  # q/k/v and o
    assert attention_bytes(spec, "native") == 2 * weights
    rows = spec.attention.q_width + 2 * spec.attention.kv_width + spec.hidden  # a float32 scale per row
    assert attention_bytes(spec, "int8") == weights + 4 * rows
    assert attention_bytes(spec, "int4") == pytest.approx(weights * (0.5 + 4 / 128))
    assert attention_bytes(spec, "hqq4") == pytest.approx(weights * (0.5 + 4 / 64))
    saved = attention_bytes(spec, "native") - attention_bytes(spec, "hqq4")
    assert dense_layer_bytes(spec, 0, "hqq4") == spec.layer_dense_bytes(0) - saved
    factory = NodeFactory(spec, attention_format="hqq4")
    copy = factory.node(Op.PAGE_COPY, Lane.GPU_H2D, 0)
    assert (copy.bytes, copy.flops) == (dense_layer_bytes(spec, 0, "hqq4"), weights)
    assert factory.node(Op.W_STAGE, Lane.GPU_H2D, 0).bytes == 2 * copy.bytes
    assert factory.node(Op.EVICT, Lane.GPU_COMPUTE, 0).bytes == spec.layer_dense_bytes(0)  # held dequantized
    assert factory.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=1).bytes == spec.expert_bytes  # experts: native
    mla = NodeFactory(preset("deepseek-v3", layers=2), attention_format="int4")
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        mla.node(Op.PAGE_COPY, Lane.GPU_H2D, 0)


@pytest.mark.parametrize("form", ["int8", "int4", "hqq4"])
def test_q_k_v_and_o_hold_their_quantized_values_in_place(folders, form: str) -> None:
    model = load_model(folders["mixtral"])
    before = [(lw.attn.qkv.clone(), lw.attn.o.clone(), lw.attn.qkv.data_ptr()) for lw in model.weights.layers]
    norms = [lw.attn.input_norm.clone() for lw in model.weights.layers]
    for lw in model.weights.layers:
        quantize_layer_attention(model.spec, lw, form, torch.device("cpu"))  # type: ignore[arg-type]
    for lw, (qkv, o, where), norm in zip(model.weights.layers, before, norms, strict=True):
        assert lw.attn.qkv.data_ptr() == where  # overwritten in its arena slot, not a second copy
        assert torch.equal(lw.attn.qkv, quantize_weight(qkv, form).dequantize(qkv.dtype))  # type: ignore[arg-type]
        assert torch.equal(lw.attn.o, quantize_weight(o, form).dequantize(o.dtype))  # type: ignore[arg-type]
        assert 0 < rel_err(lw.attn.qkv, qkv) < (0.01 if form == "int8" else 0.12)
        assert torch.equal(lw.attn.input_norm, norm)


@pytest.fixture(scope="module")
def quantized(folders) -> tuple[MoEModel, object]:
    """Mixtral with hqq4 experts and hqq4 attention (Klotski(q)'s setting) and an hqq4 LM head
    (--lm-head-format), and eager's run on it."""
    model = load_model(folders["mixtral"], packing=Packing("hqq4", "hqq4", None, "hqq4"))
    return model, run_eager(model)


@pytest.mark.parametrize("name", sorted(available()))
def test_every_scheduler_gives_eagers_tokens_with_quantized_attention(quantized, name: str) -> None:
    model, (ref_results, ref_logits) = quantized
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5, expert_format="hqq4")
    (results, logits), _runtime = run_scheduler(model, name, policy, device="cpu")
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert all(rel_err(a, b) <= 1e-5 for a, b in zip(ours, ref, strict=True))


def test_the_error_is_measured_with_the_attention_quantized_too(folders) -> None:
    folder = folders["mixtral"]
    reference = last_logits(load_model(folder), PROMPTS)
    errors: dict[tuple[str, str], float] = {}
    for experts, attention in (("hqq4", "native"), ("native", "hqq4"), ("hqq4", "hqq4")):
        packing = Packing(experts, attention)  # type: ignore[arg-type]
        model = load_model(folder, packing=packing)
        error = measured(model, folder, packing, PROMPTS)
        assert error is not None and error.max_rel is not None and error.attention_format == attention
        assert error.max_rel == pytest.approx(float(max(
            (last_logits(model, PROMPTS) - reference).norm(dim=-1) / reference.norm(dim=-1)
        )), rel=1e-5)  # fmt: skip
        errors[(experts, attention)] = error.max_rel
    assert errors[("native", "hqq4")] > 0 and errors[("hqq4", "hqq4")] > errors[("hqq4", "native")]


def _run(folder: Path, tmp_path: Path, out: str, *flags: str) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n{"id": 2, "input_ids": [8, 9]}\n')
    return ["run", "--model", str(folder), "--prompts", str(prompts), "--output", str(tmp_path / out),
            "-n", "3", "--greedy", *flags]  # fmt: skip


def test_a_run_reports_and_records_what_it_quantized(
    folders, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    flags = ["--scheduler", "klotski", "--json", "--attention-format", "hqq4"]
    assert main([*_run(folders["mixtral"], tmp_path, "both.jsonl", *flags, "--expert-format", "hqq4")]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])["quantization"]
    assert (report["expert_format"], report["attention_format"], report["prompts"]) == ("hqq4", "hqq4", 2)
    assert 0 < report["logits_rel_err_mean"] <= report["logits_rel_err_max"] < 0.5
    said = " ".join((captured.out + captured.err).split())
    both = "experts quantized to hqq4 and attention (q/k/v and o projections) quantized to hqq4 on load"
    assert both in said
    record = json.loads((tmp_path / ".both.jsonl.run.json").read_text())
    assert record["settings"]["--attention-format"] == "hqq4" and record["quantization"] == report
    assert main(_run(folders["mixtral"], tmp_path, "attention.jsonl", *flags)) == 0  # attention alone
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantization"]
    assert (alone["expert_format"], alone["attention_format"]) == ("native", "hqq4")
    settings = json.loads((tmp_path / ".attention.jsonl.run.json").read_text())["settings"]
    assert settings["--attention-format"] == "hqq4" and "--expert-format" not in settings


def test_bad_combinations_are_one_line_and_exit_2(
    folders, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tests.test_fp8 import write_pair

    write_pair(hf_model("mixtral"), tmp_path / "fp8", tmp_path / "ref")
    runs = {
        "fp4": (folders["mixtral"], ["--attention-format", "fp4"], "invalid choice: 'fp4'"),
        "mla": (folders["deepseek_v3"], ["--attention-format", "int4"], "multi-head latent attention"),
        "fp8": (tmp_path / "fp8", ["--attention-format", "int4"], "is stored quantized already"),
        "ray": (folders["mixtral"], ["--attention-format", "int4", "--ray", "local"], "--ray's replicas"),
    }
    for name, (folder, flags, message) in runs.items():
        code = main(_run(folder, tmp_path, f"{name}.jsonl", *flags))
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flowmoe: error")]
        assert code == 2 and len(errors) == 1 and message in errors[0]
        assert not (tmp_path / f"{name}.jsonl").exists()
    assert main(["simulate", "--model", "deepseek-v3", "--layers", "2", "--attention-format", "int4"]) == 2
    assert "multi-head latent attention" in capsys.readouterr().err


def test_simulate_prices_klotskis_dense_copies_packed_and_plan_says_it_changes_nothing(
    capsys: pytest.CaptureFixture,
) -> None:
    model = ["--model", "mixtral-8x7b", "--layers", "2", "--dtype", "bfloat16", "--hardware", "h100"]
    policy = ["-s", "klotski", "--batch-size", "8", "--micro-batches", "2", "--weights-gpu-share", "0"]
    base = ["simulate", *model, *policy, "--decode-samples", "1", "--gen-len", "3", "--json"]
    h2d = {}
    for form in ("native", "hqq4"):
        assert main([*base, "--attention-format", form]) == 0
        lanes = json.loads(capsys.readouterr().out)["results"][0]["lanes"]
        h2d[form] = next(lane["bytes"] for lane in lanes if lane["lane"] == "gpu.h2d")
    spec = preset("mixtral-8x7b", layers=2, dtype="bfloat16")
    saved = spec.layer_dense_bytes(0) - dense_layer_bytes(spec, 0, "hqq4")
    copies = (h2d["native"] - h2d["hqq4"]) / saved  # every dense copy of the run, each this much smaller
    assert copies >= spec.layers and copies == int(copies)
    assert main(["plan", *model[:2], *model[4:], "--max-batch", "64", "--attention-format", "hqq4"]) == 0
    assert "changes none of its figures" in " ".join(capsys.readouterr().out.split())
