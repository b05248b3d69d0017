"""GPTQ, AWQ and compressed-tensors checkpoints (tests/int4_packers.py writes them from the formats'
specifications) load to exactly what an independent numpy unpacking of their tensors gives, keep
their experts packed as stored under --expert-format int4 (int8), give eager's tokens under every
scheduler, say so in a run's report, and refuse bad configs and tensors in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowmoe.cli import main
from flowmoe.core.errors import CheckpointError, ConfigError
from flowmoe.core.policy import Policy
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model import int4_checkpoints
from flowmoe.model.checkpoint import Checkpoint
from flowmoe.model.int4_weights import AWQWeight, GPTQWeight, PackQuantizedWeight
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.packed_experts import kernel_form
from flowmoe.model.quantized import Int4Weight
from flowmoe.schedulers.registry import available
from tests.helpers import rel_err
from tests.hf_models import COMMON, hf_model, save_hf
from tests.int4_packers import awq, gptq, pack_quantized, write_quantized
from tests.schedule_fixtures import run_eager, run_scheduler

# ---- the independent unpacking: bytes of little-endian int32 words, nibbles (or bytes) of each


def _levels(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their unsigned levels along `axis`, read byte by byte, low nibble first."""
    raw = np.ascontiguousarray(np.moveaxis(words, axis, -1)).astype("<i4").view(np.uint8)  # [..., 4 n]
    if bits == 8:
        out = raw.astype(np.int64)
    else:
        out = np.empty((*raw.shape[:-1], 2 * raw.shape[-1]), np.int64)
        out[..., 0::2], out[..., 1::2] = raw & 0x0F, raw >> 4
    return np.moveaxis(out, -1, axis)


def _grouped(levels: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """levels [R, C], zeros and scales [R, G], g_idx [C] -> float32 [R, C], column by column."""
    out = np.empty(levels.shape, np.float32)
    for c in range(levels.shape[1]):
        g = g_idx[c]
        out[:, c] = (levels[:, c] - zeros[:, g]).astype(np.float32) * scales[:, g].astype(np.float32)
    return out


def numpy_gptq(t: dict[str, np.ndarray], bits: int, group: int, act_order: bool, v1: bool) -> np.ndarray:
    levels = _levels(t["qweight"], bits, 0).T  # [R, C]
    zeros = (_levels(t["qzeros"], bits, 1) + (1 if v1 else 0)) % (1 << bits)  # [G, R]
    cols = levels.shape[1]
    g_idx = t["g_idx"] if act_order else np.arange(cols) // (cols if group == -1 else group)
    return _grouped(levels, zeros.T, t["scales"].T, g_idx)


def numpy_awq(t: dict[str, np.ndarray], group: int) -> np.ndarray:
    def columns(words: np.ndarray) -> np.ndarray:  # [N, k] words -> [N, 8 k]: slot i is column order[i]
        slots = _levels(words, 4, 1)
        out = np.empty_like(slots)
        for slot, column in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
            out[:, column::8] = slots[:, slot::8]
        return out

    levels = columns(t["qweight"]).T  # [R, C]
    return _grouped(levels, columns(t["qzeros"]).T, t["scales"].T, np.arange(levels.shape[1]) // group)


def numpy_pack_quantized(t: dict[str, np.ndarray], bits: int, group: int) -> np.ndarray:
    rows, cols = (int(v) for v in t["weight_shape"])
    signed = _levels(t["weight_packed"], bits, 1)[:, :cols] - (1 << (bits - 1))  # [R, C]
    scales = t["weight_scale"]  # [R, G]
    if "weight_zero_point" in t:
        zeros = _levels(t["weight_zero_point"], bits, 0)[:rows] - (1 << (bits - 1))
    else:
        zeros = np.zeros(scales.shape, np.int64)
    g_idx = t.get("weight_g_idx", np.arange(cols) // (cols if group == -1 else group))
    return _grouped(signed, zeros, scales, g_idx)


# ---- the formats under test: (quantization_config, packer, independent unpacking)

FORMATS: dict[str, tuple[dict[str, Any], Any, Any]] = {
    # act-order, asymmetric, v1 zeros, a ragged last group (48 columns of w2 in groups of 32)
    "gptq": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            "true_sequential": True,
        },
        lambda w, seed: gptq(w, 4, 32, True, False, True, seed),
        lambda t: numpy_gptq(t, 4, 32, True, True),
    ),
    "gptq8_v2": (
        {
            "quant_method": "gptq",
            "bits": 8,
            "group_size": -1,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq_v2",
        },
        lambda w, seed: gptq(w, 8, -1, False, True, False, seed),
        lambda t: numpy_gptq(t, 8, -1, False, False),
    ),
    "awq": (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 8,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        },
        lambda w, seed: awq(w, 8),
        lambda t: numpy_awq(t, 8),
    ),
    "ct_group": (  # W4A16 asymmetric, groups by activation order
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "input_activations": None,
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": False,
                        "strategy": "group",
                        "group_size": 8,
                        "actorder": "group",
                        "dynamic": False,
                    },
                }
            },
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
        },
        lambda w, seed: pack_quantized(w, 4, 8, False, True, seed),
        lambda t: numpy_pack_quantized(t, 4, 8),
    ),
    "ct_channel": (  # W4A16 symmetric, one scale per output channel
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
                }
            },
            "ignore": ["lm_head"],
        },
        lambda w, seed: pack_quantized(w, 4, -1, True, False, seed),
        lambda t: numpy_pack_quantized(t, 4, -1),
    ),
}
CASES = [("gptq", "mixtral"), ("gptq8_v2", "qwen3_moe"), ("awq", "qwen3_moe"), ("awq", "deepseek_v3"),
         ("ct_group", "deepseek_v3"), ("ct_channel", "mixtral")]  # fmt: skip


def _write(root: Path, form: tuple[dict[str, Any], Any, Any], model) -> tuple[Path, Path]:
    """A tiny model as a checkpoint of `form` (a FORMATS value), and beside it the same weights as
    the independent unpacking gives them (float32, unquantized layout)."""
    quant, pack, unpack = form
    plain = save_hf(model, root / "plain")
    folder = write_quantized(plain, root / "quantized", quant, pack)
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open)
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        reference = {name: f.get_tensor(name) for name in names if name in stored}
    for name in names:
        if name not in stored:  # quantized: the module's tensors, unpacked by numpy
            module = name.removesuffix(".weight")
            tensors = {k[len(module) + 1 :]: v for k, v in stored.items() if k.startswith(f"{module}.")}
            reference[name] = torch.from_numpy(unpack(tensors))
    (root / "ref").mkdir()
    save_file(reference, str(root / "ref" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(plain / "config.json", root / "ref" / "config.json")
    return folder, root / "ref"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    return {
        (f, fam): _write(tmp_path_factory.mktemp(f"{f}-{fam}"), FORMATS[f], hf_model(fam)) for f, fam in CASES
    }


def _weights(model: MoEModel) -> list[torch.Tensor]:
    out = [model.weights.embed, model.weights.lm_head]
    for lw in model.weights.layers:
        out += [
            getattr(lw.attn, name)
            for name in ("qkv", "o", "q_b", "kv_b")
            if getattr(lw.attn, name) is not None
        ]
        ffns = [*(lw.experts or [x.to_ffn() for x in lw.packed]), lw.shared, lw.dense]
        out += [t for ffn in ffns if ffn is not None for t in (ffn.gate_up, ffn.down)]
    return out


def _logits(model: MoEModel, ids: torch.Tensor) -> torch.Tensor:
    batch, length = ids.shape
    layout = TokenLayout(tuple(range(batch)), (length,) * batch, (0,) * batch)
    with torch.inference_mode():
        return model.forward(ids.reshape(-1), model.new_cache(batch, length), layout, all_rows=True)


def test_the_independent_unpacking_reads_back_what_was_packed() -> None:
    """The numpy reader against the packer's own levels: the test's two halves agree on each layout."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 48)).astype(np.float32)
    for form, (_, pack, unpack) in FORMATS.items():
        dequantized = unpack({k: np.asarray(v) for k, v in pack(w, 1).items()})
        assert dequantized.shape == w.shape
        bound = 0.02 if "8" in form else 0.25  # round to nearest: well within a level of the weights
        assert np.linalg.norm(dequantized - w) / np.linalg.norm(w) < bound, form


@pytest.mark.parametrize(("form", "family"), CASES)
def test_checkpoint_dequantizes_to_the_independent_unpacking(checkpoints, form: str, family: str) -> None:
    folder, ref = checkpoints[(form, family)]
    ours, plain = load_model(folder), load_model(ref)
    for a, b in zip(_weights(ours), _weights(plain), strict=True):
        assert torch.equal(a, b)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(ours, ids), _logits(plain, ids))
    fmt = FORMATS[form][0]
    form_of = {"gptq": GPTQWeight, "awq": AWQWeight, "compressed-tensors": PackQuantizedWeight}
    ours = load_model(folder, packing=Packing("int8" if fmt.get("bits") == 8 else "int4"))
    moe = [lw for lw in ours.weights.layers if lw.router is not None]
    assert all(not lw.experts and len(lw.packed) == ours.spec.moe.experts for lw in moe)
    kept = (form_of[fmt["quant_method"]], Int4Weight)  # Int4Weight: converted exactly (as_int4)
    assert all(isinstance(w, kept) for lw in moe for x in lw.packed for w in x.weights())
    assert all(x.nbytes < x.ffn_nbytes / (3 if fmt.get("bits") == 8 else 4) for lw in moe for x in lw.packed)
    for a, b in zip(_weights(ours), _weights(plain), strict=True):  # the packed experts too
        assert torch.equal(a, b)


# ---- the kernels' own int4 layout, where a checkpoint's converts exactly (int4_weights.as_int4)

CT_IGNORE = ["lm_head", "re:.*block_sparse_moe.gate$"]


def _ct(group: int) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups,
            "ignore": CT_IGNORE}  # fmt: skip


def _gptq(group: int, act_order: bool, sym: bool) -> tuple[dict[str, Any], Any, Any]:
    """4-bit GPTQ, v1 zeros: (quantization_config, packer, independent unpacking)."""
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
             "checkpoint_format": "gptq"}  # fmt: skip
    return (
        quant,
        lambda w, seed: gptq(w, 4, group, act_order, sym, True, seed),
        lambda t: numpy_gptq(t, 4, group, act_order, True),
    )


def _off_float16(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """compressed-tensors scales stored float32, off float16's grid (float16 cannot hold them)."""
    return {**packed, "weight_scale": packed["weight_scale"].astype(np.float32) * np.float32(1 + 2**-20)}


CONVERTED: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "gptq_g64": _gptq(64, False, False),
    "gptq_channel": _gptq(-1, False, True),
    "awq_g64": (
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
        lambda w, seed: awq(w, 64),
        lambda t: numpy_awq(t, 64),
    ),
    "ct_g128": (
        _ct(128),
        lambda w, seed: pack_quantized(w, 4, 128, True, False, seed),
        lambda t: numpy_pack_quantized(t, 4, 128),
    ),
}
KEPT: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "gptq_act_order": _gptq(64, True, False),
    "ct_float32_scales": (
        _ct(64),
        lambda w, seed: _off_float16(pack_quantized(w, 4, 64, True, False, seed)),
        lambda t: numpy_pack_quantized(t, 4, 64),
    ),
}


@pytest.fixture(scope="module")
def kernel_sized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Mixtral with every projection's columns a multiple of 128 (hidden and intermediate), as a
    checkpoint of each layout above."""
    import transformers

    config = transformers.MixtralConfig(
        **{
            **COMMON,
            "hidden_size": 128,
            "intermediate_size": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        }
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    forms = {**CONVERTED, **KEPT}
    return {name: _write(tmp_path_factory.mktemp(name), form, model) for name, form in forms.items()}


@pytest.mark.parametrize("form", [*CONVERTED, *KEPT])
def test_exact_layouts_load_into_the_kernels_int4_layout(kernel_sized, form: str) -> None:
    """Without act-order, at groups of 64 columns or a multiple, with float16 scales: every expert in
    Int4Weight, which the CPU's packed kernels take, dequantizing to the numpy unpacking bit for bit;
    else kept as stored."""
    folder, ref = kernel_sized[form]
    ours, plain = load_model(folder, packing=Packing("int4")), load_model(ref)
    experts = [x for lw in ours.weights.layers for x in lw.packed]
    converted = form in CONVERTED
    assert experts and all(isinstance(w, Int4Weight) == converted for x in experts for w in x.weights())
    assert all((kernel_form(x) is not None) == converted for x in experts)
    for a, b in zip(_weights(ours), _weights(plain), strict=True):  # the packed experts dequantized too
        assert torch.equal(a, b)


def test_eager_gives_the_same_tokens_on_the_converted_experts(kernel_sized, monkeypatch) -> None:
    """The GPTQ experts converted (read by the packed kernels) against GPTQ's layout as stored
    (dequantized in torch, the path before the conversion)."""
    folder = kernel_sized["gptq_g64"][0]
    converted = run_eager(load_model(folder, packing=Packing("int4")))
    monkeypatch.setattr(int4_checkpoints, "as_int4", lambda weight: weight)
    stored = load_model(folder, packing=Packing("int4"))
    assert all(
        isinstance(w, GPTQWeight) for lw in stored.weights.layers for x in lw.packed for w in x.weights()
    )
    before = run_eager(stored)
    assert [r.output_ids for r in converted[0]] == [r.output_ids for r in before[0]]


@pytest.fixture(scope="module")
def gptq_mixtral(checkpoints) -> tuple[MoEModel, Any]:
    """GPTQ act-order Mixtral with its experts packed as stored, and eager's run on it."""
    folder = checkpoints[("gptq", "mixtral")][0]
    model = load_model(folder, packing=Packing("int4"))
    return model, run_eager(model)


@pytest.mark.parametrize("name", sorted(available()))
def test_every_scheduler_gives_eagers_tokens_on_a_gptq_checkpoint(gptq_mixtral, name: str) -> None:
    """Half the experts cross the link in GPTQ's layout and are dequantized where they land."""
    model, (ref_results, ref_logits) = gptq_mixtral
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5, expert_format="int4")
    (results, logits), runtime = run_scheduler(model, name, policy, device="cpu")
    assert runtime.weights.expert_format == "int4"
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert all(rel_err(a, b) <= 1e-5 for a, b in zip(ours, ref, strict=True))


@pytest.mark.parametrize(("form", "family"), [("awq", "qwen3_moe"), ("ct_group", "deepseek_v3")])
@pytest.mark.parametrize("name", ["cgopipe", "lru-cache"])
def test_awq_and_compressed_tensors_experts_give_eagers_tokens(checkpoints, form, family, name) -> None:
    folder = checkpoints[(form, family)][0]
    model = load_model(folder, packing=Packing("int4"))
    ref_results, ref_logits = run_eager(model)
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5, expert_format="int4")
    (results, logits), _ = run_scheduler(model, name, policy, device="cpu")
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert all(rel_err(a, b) <= 1e-5 for a, b in zip(ours, ref, strict=True))


def test_a_run_says_its_weights_came_quantized(checkpoints, tmp_path: Path, capsys) -> None:
    folder = checkpoints[("gptq", "mixtral")][0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n{"id": 2, "input_ids": [8, 9]}\n')
    tokens = {}
    for form in ("native", "int4"):
        out = tmp_path / f"{form}.jsonl"
        args = ["run", "--model", str(folder), "--prompts", str(prompts), "--output", str(out), "-n", "3",
                "--greedy", "--scheduler", "cgopipe", "--weights-gpu-share", "0", "--json",
                "--expert-format", form]  # fmt: skip
        assert main(args) == 0
        captured = capsys.readouterr()
        report = json.loads(captured.out.strip().splitlines()[-1])["quantization"]
        assert report["expert_format"] == form and report["quantized_on_load"] is False
        assert report["checkpoint"] == "gptq 4-bit, group 32, asymmetric, act-order, v1 zeros"
        assert report["logits_rel_err_max"] is None  # the checkpoint has no unquantized weights
        assert "weights quantized by the checkpoint (gptq 4-bit" in captured.out + captured.err
        record = json.loads((tmp_path / f".{form}.jsonl.run.json").read_text())
        assert record["quantization"] == report
        tokens[form] = sorted(
            (r["id"], r["output_ids"]) for r in map(json.loads, out.read_text().splitlines())
        )
    assert tokens["int4"] == tokens["native"]  # packed experts are the same function


def test_the_expert_format_must_be_the_checkpoints_own(checkpoints) -> None:
    folder = checkpoints[("gptq", "mixtral")][0]
    for form in ("int8", "hqq4"):
        message = (
            f"--expert-format {form}: .* is a gptq 4-bit, .* checkpoint; run it with --expert-format int4"
        )
        with pytest.raises(ConfigError, match=message):
            load_model(folder, packing=Packing(form))  # type: ignore[arg-type]


# ---- refusals: one line naming the field or tensor


def _copy(src: Path, dst: Path, config: dict[str, Any] | None = None, edit=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        whole = json.loads((dst / "config.json").read_text())
        whole["quantization_config"] = {**whole["quantization_config"], **config}
        (dst / "config.json").write_text(json.dumps(whole))
    if edit is not None:
        with safe_open(str(dst / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open)
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


EXPERT = "model.layers.1.block_sparse_moe.experts.2.w2"  # [64, 48]: 2 groups of 32 columns
BAD_CONFIGS = [
    ("gptq", {"bits": 3}, '"quantization_config.bits" must be 4 or 8'),
    ("gptq", {"checkpoint_format": "marlin"}, '"quantization_config.checkpoint_format" must be "gptq"'),
    ("gptq", {"group_size": 0}, '"quantization_config.group_size" must be -1 (per channel) or a positive'),
    ("gptq", {"dynamic": {"-:.*experts.*": {}}}, '"quantization_config.dynamic" must be empty'),
    (
        "gptq",
        {"modules_to_not_convert": ["model.layers.0.block_sparse_moe.experts"]},
        "leaves it unconverted",
    ),
    (
        "gptq",
        {"desc_act": False, "group_size": 16},
        "tensor model.layers.0.self_attn.q_proj.qzeros has shape [2, 8], expected [4, 8]",
    ),
    ("awq", {"version": "gemv"}, '"quantization_config.version" must be "gemm"'),
    ("ct_channel", {"format": "int-quantized"}, '"quantization_config.format" must be "pack-quantized"'),
    (
        "ct_channel",
        {"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "tensor"}}}},
        '"quantization_config.config_groups.g.weights.strategy" must be "group" or "channel"',
    ),
    (
        "ct_channel",
        {
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "strategy": "channel", "symmetric": False},
                }
            }
        },
        "tensor model.layers.0.self_attn.q_proj.weight_zero_point is missing",
    ),
]


@pytest.mark.parametrize(("form", "change", "message"), BAD_CONFIGS)
def test_bad_quantization_configs_are_named(checkpoints, tmp_path: Path, form, change, message) -> None:
    family = "mixtral" if form != "awq" else "qwen3_moe"
    folder = _copy(checkpoints[(form, family)][0], tmp_path / "ckpt", change)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(folder)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_tensors_are_named_before_any_weight_is_read(checkpoints, tmp_path: Path) -> None:
    source = checkpoints[("gptq", "mixtral")][0]
    edits = {
        "missing qzeros": (
            lambda t: t.pop(f"{EXPERT}.qzeros"),
            f"tensor {EXPERT}.qzeros is missing (gptq module",
        ),
        "missing g_idx": (lambda t: t.pop(f"{EXPERT}.g_idx"), f"tensor {EXPERT}.g_idx is missing"),
        "wrong scales": (
            lambda t: t.__setitem__(f"{EXPERT}.scales", torch.ones(1, 64, dtype=torch.float16)),
            f"tensor {EXPERT}.scales has shape [1, 64], expected [2, 64]",
        ),
        "wrong qweight dtype": (
            lambda t: t.__setitem__(f"{EXPERT}.qweight", t[f"{EXPERT}.qweight"].float()),
            f"tensor {EXPERT}.qweight has dtype F32, expected I32",
        ),
    }
    for case, (edit, message) in edits.items():
        with pytest.raises(CheckpointError) as info:
            Checkpoint.open(_copy(source, tmp_path / case.replace(" ", "-"), edit=edit))
        assert message in str(info.value) and "\n" not in str(info.value), case
    bad_groups = _copy(source, tmp_path / "g_idx", edit=lambda t: t[f"{EXPERT}.g_idx"].fill_(7))
    with pytest.raises(CheckpointError, match=f"tensor {EXPERT}.g_idx gives groups outside 0..1"):
        load_model(bad_groups)


def test_cli_bad_int4_checkpoint_is_one_line_exit_2(checkpoints, tmp_path: Path, capsys) -> None:
    folder = _copy(checkpoints[("gptq", "mixtral")][0], tmp_path / "ckpt", {"checkpoint_format": "bitblas"})
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n')
    code = main(["run", "--model", str(folder), "--prompts", str(prompts), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not out.exists()
    assert err[0].startswith("flowmoe: error: ") and '"quantization_config.checkpoint_format"' in err[0]
