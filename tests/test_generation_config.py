"""A checkpoint's generation_config.json (issue 27, item 8): its eos ids end sequences, its
recommended sampling is `flowmoe run`'s default (transformers' reading: greedy unless do_sample),
and each sampling flag given overrides its field."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.cli.run import sampling_from
from flowmoe.core.errors import ConfigError
from flowmoe.core.generation_config import GenerationConfig, read_generation_config
from flowmoe.core.spec import ModelSpec
from flowmoe.model.builtin import ensure_builtin

PROMPTS = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [151645, 151643]}


def _write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def _args(model: Path | None, **flags: object) -> argparse.Namespace:
    given = {"greedy": False, "temperature": None, "top_p": None, "top_k": None, "seed": 0} | flags
    return argparse.Namespace(model=str(model) if model else None, **given)


def test_read_as_transformers_does(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) is None
    qwen = read_generation_config(_write(tmp_path / "q", QWEN3))
    assert qwen is not None
    assert qwen == GenerationConfig((151645, 151643), True, 0.6, 0.95, 20)
    assert qwen.sampling() == (0.6, 0.95, 20)
    # no do_sample (transformers' default False): greedy, whatever temperature it names
    greedy = read_generation_config(_write(tmp_path / "g", {"temperature": 0.7, "eos_token_id": 2}))
    assert greedy is not None and greedy.sampling() == (0.0, 1.0, 0)
    # do_sample with fields left out: transformers' defaults (temperature 1, top_p 1, top_k 50)
    default = read_generation_config(_write(tmp_path / "d", {"do_sample": True, "top_k": None}))
    assert default is not None and default.sampling() == (1.0, 1.0, 50)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0}, "top_p 0 is out of range"),
        ({"top_p": 1.5}, "top_p 1.5 is out of range"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"do_sample": "yes"}, "do_sample must be true or false"),
        ({"eos_token_id": ["2"]}, "eos_token_id must be a token id"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_fields_are_one_error_naming_the_file(tmp_path: Path, data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        read_generation_config(_write(tmp_path, data))
    assert "generation_config.json" in str(err.value)


def test_read_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    with path.open("wb") as f:  # sparse: 17 MiB of nothing, past config files' 16 MiB bound
        f.truncate(17 * 2**20)
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        read_generation_config(tmp_path)


def test_flags_override_the_checkpoint(tmp_path: Path) -> None:
    folder = _write(tmp_path / "q", QWEN3)
    assert sampling_from(_args(folder)).temperature == 0.6
    s = sampling_from(_args(folder))
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 20)
    s = sampling_from(_args(folder, temperature=0.9, top_k=0))
    assert (s.temperature, s.top_p, s.top_k) == (0.9, 0.95, 0)
    assert sampling_from(_args(folder, greedy=True)).greedy
    assert sampling_from(_args(folder, temperature=0.0)).greedy
    s = sampling_from(_args(None))  # the built-in model, a preset: greedy as before
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 0)
    s = sampling_from(_args(_write(tmp_path / "g", {"eos_token_id": 2}), top_p=0.5))
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 0)


def _builtin_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(ensure_builtin(), folder)
    return folder


def test_eos_ids_join_config_json(tmp_path: Path) -> None:
    folder = _builtin_copy(tmp_path)
    base = ModelSpec.from_hf(folder).eos_token_ids
    _write(folder, {"eos_token_id": [*base, 7, 7, 10**9]})  # 10**9: outside the vocabulary, dropped
    assert ModelSpec.from_hf(folder).eos_token_ids == (*base, 7)
    assert ModelSpec.from_hf(folder / "config.json").eos_token_ids == (*base, 7)


def test_run_stops_at_generation_configs_eos(tmp_path: Path) -> None:
    folder = _builtin_copy(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')

    def run(out: str, *flags: str) -> int:
        argv = ["run", "--model", str(folder), "--prompts", str(prompts), "--output", str(tmp_path / out)]
        return main([*argv, "--max-new-tokens", "6", *flags])

    assert run("free.jsonl") == 0
    free = json.loads((tmp_path / "free.jsonl").read_text())["output_ids"]
    assert len(free) == 6
    _write(folder, {"eos_token_id": [free[2]], "do_sample": False})
    assert run("stopped.jsonl") == 0
    stopped = json.loads((tmp_path / "stopped.jsonl").read_text())["output_ids"]
    assert stopped[:3] == free[:3] and len(stopped) <= 3


def test_run_samples_as_the_checkpoint_recommends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sampling taken from the file is the job's setting: resuming with --greedy is another job."""
    folder = _write(_builtin_copy(tmp_path), {"do_sample": True, "temperature": 0.7, "top_k": 5})
    argv = ["run", "--model", str(folder), "--prompts", str(PROMPTS), "--output", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "3", "--greedy"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--temperature" in err and os.path.basename(tmp_path / "o.jsonl") in err
