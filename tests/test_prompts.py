"""Prompt files: every bad line is reported with its number; good lines still run."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowmoe.core.errors import PromptFileError
from flowmoe.jobs.prompts import read_prompts

GOOD = '{"id": "a", "prompt": "hello"}\n{"id": 7, "input_ids": [1, 2, 3]}\n'


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    return path


def test_good_lines(tmp_path: Path) -> None:
    result = read_prompts(_write(tmp_path, GOOD + "\n"), vocab=10, can_tokenize=True)
    assert [p.id for p in result.prompts] == ["a", 7]
    assert result.prompts[1].input_ids == (1, 2, 3) and not result.errors


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "x"}', 'missing "id"'),
        ('{"id": "b", "prompt": "x", "input_ids": [1]}', 'give exactly one of "prompt" and "input_ids"'),
        ('{"id": "b"}', 'give exactly one of "prompt" and "input_ids"'),
        ('{"id": "b", "input_ids": [1, 99]}', '"input_ids" holds 99, not a token id in [0, 10)'),
        ('{"id": "b", "input_ids": []}', '"input_ids" must be a non-empty list'),
        ('{"id": "b", "prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"id": "a", "prompt": "again"}', "duplicate id 'a'"),
        ('{"id": true, "prompt": "x"}', '"id" must be a string or an integer'),
    ],
)
def test_bad_line_reported_with_number(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, GOOD + line + "\n")
    result = read_prompts(path, vocab=10, can_tokenize=True)
    assert len(result.prompts) == 2
    assert len(result.errors) == 1
    assert result.errors[0].startswith(f"{path}:3: ") and message in result.errors[0]


def test_text_prompt_without_tokenizer(tmp_path: Path) -> None:
    result = read_prompts(_write(tmp_path, GOOD), vocab=10, can_tokenize=False)
    assert [p.id for p in result.prompts] == [7]
    assert "needs a tokenizer.json" in result.errors[0]


def test_no_usable_line_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match=r"no usable prompt lines; first problem: .*:1: not valid JSON"):
        read_prompts(_write(tmp_path, "garbage\n"), vocab=10, can_tokenize=True)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="prompt file not found"):
        read_prompts(tmp_path / "nope.jsonl", vocab=10, can_tokenize=True)
