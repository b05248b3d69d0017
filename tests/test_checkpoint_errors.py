"""Bad checkpoints fail before any weight is read, with one line naming the file and tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowmoe.core.errors import CheckpointError, ConfigError
from flowmoe.model.loading import load_model
from tests.hf_models import hf_model, save_hf


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _one_line_error(exc_info: pytest.ExceptionInfo) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_missing_shard(tmp_path: Path) -> None:
    folder = save_hf(hf_model("mixtral"), tmp_path / "sharded", shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    assert f"{shard}: shard listed in model.safetensors.index.json is missing" == _one_line_error(info)


def test_missing_tensor(mixtral_folder: Path, tmp_path: Path) -> None:
    folder = _copy(mixtral_folder, tmp_path / "ckpt")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    _rewrite(folder, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    assert _one_line_error(info) == f"{folder}: tensor {name} is missing from the checkpoint"


def test_wrong_shape(mixtral_folder: Path, tmp_path: Path) -> None:
    folder = _copy(mixtral_folder, tmp_path / "ckpt")
    name = "model.layers.2.self_attn.k_proj.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, torch.zeros(8, 64)))
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    message = _one_line_error(info)
    assert message == f"{folder / 'model.safetensors'}: tensor {name} has shape [8, 64], expected [32, 64]"


def test_wrong_dtype(mixtral_folder: Path, tmp_path: Path) -> None:
    folder = _copy(mixtral_folder, tmp_path / "ckpt")
    name = "model.norm.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError) as info:
        load_model(folder)
    assert "tensor model.norm.weight has dtype I32, expected one of F32, F16, BF16" in _one_line_error(info)


def test_unknown_architecture(mixtral_folder: Path, tmp_path: Path) -> None:
    folder = _copy(mixtral_folder, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_model(folder)
    message = _one_line_error(info)
    assert "unsupported architecture LlamaForCausalLM; supported: MixtralForCausalLM" in message
    assert "GptOssForCausalLM" in message


def test_config_not_json(mixtral_folder: Path, tmp_path: Path) -> None:
    folder = _copy(mixtral_folder, tmp_path / "ckpt")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        load_model(folder)


def test_unknown_model_source() -> None:
    with pytest.raises(ConfigError, match="neither a checkpoint folder nor a preset"):
        load_model("no/such/model")


def test_preset_cut_to_layers() -> None:
    from flowmoe.core.presets import preset

    spec = preset("gpt-oss-20b", layers=3)
    assert spec.layers == 3 and spec.attention.windows == (128, None, 128)
    assert preset("mixtral-8x7b").total_bytes / 2 == pytest.approx(46.7e9, rel=0.01)
