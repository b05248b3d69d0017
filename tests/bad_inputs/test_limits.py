"""Numbers and sizes from input (issue 24, classes 3, 4, 6 and 7): every number parsed has a range,
every allocation sized from input is checked before it is made, and one bad line of a job is
reported with its number while the rest runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.jsonfile import JsonProblem, parse_json
from flowmoe.core.policy import parse_bytes
from flowmoe.jobs.sampling import SamplingParams, sample
from tests.bad_inputs.test_jobs import _error

HUGE = "9" * 5000  # more digits than Python converts to an int


@pytest.mark.parametrize(
    ("text", "unique", "reason"),
    [
        (f'{{"id": {HUGE}}}', False, "an integer of more than 4300 digits"),
        (f"[1, {HUGE}]", False, "an integer of more than 4300 digits"),
        ('{"id": "a", "id": "b"}', True, 'the key "id" is given twice'),
        ('{"a": {"k": 1, "k": 2}}', True, 'the key "k" is given twice'),
        ("[" * 100_000, False, "nested too deeply"),
        ("{oops", False, "not valid JSON"),
    ],
)
def test_parse_json_gives_one_reason(text: str, unique: bool, reason: str) -> None:
    with pytest.raises(JsonProblem, match=reason):
        parse_json(text, unique_keys=unique)


def test_parse_json_keeps_repeated_keys_where_not_asked() -> None:
    assert parse_json('{"a": 1, "a": 2}') == {"a": 2}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (f'{{"id": "b", "input_ids": [{HUGE}]}}', "not valid JSON: an integer of more than 4300 digits"),
        (
            f'{{"id": "b", "prompt": "x", "extra": {HUGE}}}',
            "not valid JSON: an integer of more than 4300 digits",
        ),
        ('{"id": "good", "prompt": "x", "id": "other"}', 'the key "id" is given twice'),
        (
            '{"id": "b", "messages": [{"role": "user", "role": "x", "content": "y"}]}',
            'the key "role" is given twice',
        ),
    ],
)
def test_bad_number_or_key_fails_its_line_only(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture, line: str, reason: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [5, 6]}\n' + line + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", "--model", str(model), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "2"]) == 0  # fmt: skip
    assert [json.loads(r)["id"] for r in out.read_text().splitlines()] == ["a"]
    err = capsys.readouterr().err
    assert f"{prompts}:2: {reason}" in err and "Traceback" not in err


def test_chat_template_lone_surrogate_fails_its_line_only(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture
) -> None:
    template = "{% for m in messages %}{{ m.content }}{{ '%c' | format(55296) }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "prompt": "ok"}\n'
    )
    out = tmp_path / "o.jsonl"
    assert main(["run", "--model", str(model), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "2"]) == 0  # fmt: skip
    assert [json.loads(r)["id"] for r in out.read_text().splitlines()] == ["b"]
    assert f"{prompts}:1: chat template (tokenizer_config.json): rendered a lone surrogate (\\ud800)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("text", ["1e999GiB", "infGiB", "nanGiB", "-1GiB", "1e30GiB", "inf", "GiB"])
def test_sizes_out_of_range_are_refused_as_read(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


@pytest.mark.parametrize("command", ["simulate", "compare", "run"])
@pytest.mark.parametrize("size", ["1e999GiB", "nanGiB", "1e30GiB"])
def test_size_flags_are_one_line(capsys: pytest.CaptureFixture, command: str, size: str) -> None:
    try:
        code = main([command, "--gpu-memory", size])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    want = f"argument --gpu-memory: must be a size such as 16GiB, 24GB or 512MiB, more than 0 bytes, got '{size}'"  # noqa: E501
    assert want in _error(capsys)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-40, 1e-8])
def test_tiny_temperature_samples_the_top_token(temperature: float) -> None:
    import torch

    logits = torch.tensor([1.0, 3.0, -2.0, float("-inf")])
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=3)
    assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


def test_host_memory_bounds_the_kv_cache(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    """A model claiming 2**24 positions and a prompt long enough to need more KV cache than the host
    has: refused before the cache is allocated (it tried 51 GB on the CPU path)."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**24}))
    from flowmoe.core import memory

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "long", "input_ids": [5] * 20_000}) + "\n")
    real = memory.physical_memory
    try:
        memory.physical_memory = lambda: 2**26  # a 64 MiB host: 20k tokens of KV are over it
        code = main(["run", "--model", str(model), "--prompts", str(prompts), "--output",
                     str(tmp_path / "o.jsonl"), "--max-new-tokens", "2"])  # fmt: skip
    finally:
        memory.physical_memory = real
    assert code == 2
    assert "of KV cache" in _error(capsys) and not (tmp_path / "o.jsonl").read_bytes()


def test_config_claiming_more_weights_than_its_shards(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture
) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_local_experts": 60_000}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [5]}\n')
    code = main(
        ["run", "--model", str(model), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    )
    assert code == 2
    assert "of weights but the shards hold" in _error(capsys)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% set a='x'*4000000 %}{{ ([a]*1000)|tojson|length }}", "an input of"),  # 7.9 GB before
        ("{% set a='x'*4000000 %}{{ [a, a]|join }}", "an input of"),
        ("{% set a='x'*3000000 %}{{ {'k': a, 'l': a}|string }}", "an input of"),
        ("{{ lipsum(4000000) }}", "'lipsum' is undefined"),  # ran for minutes
    ],
)
def test_template_builders_are_bounded_before_they_run(tmp_path: Path, template: str, message: str) -> None:
    import time

    from flowmoe.core.errors import PromptFileError
    from flowmoe.model.chat import ChatTemplate

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chat = ChatTemplate.from_folder(tmp_path)
    assert chat is not None
    started = time.monotonic()
    with pytest.raises(PromptFileError, match=message):
        chat.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 10
