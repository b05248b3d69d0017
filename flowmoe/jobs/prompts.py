"""Prompt files: JSON Lines of {"id": ..., "prompt": "text"}, {"id": ..., "input_ids": [...]}
or {"id": ..., "messages": [{"role": ..., "content": ...}, ...]} (rendered by the chat template).

Each bad line is reported with its line number and skipped, so one typo does
not sink a job of thousands of prompts; a file with no usable line is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import frozen

from flowmoe.core.errors import PromptFileError


@frozen
class PromptLine:
    id: str
    line: int
    prompt: str | None
    input_ids: tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None = None


@frozen
class PromptFile:
    prompts: tuple[PromptLine, ...]
    errors: tuple[str, ...]  # one "FILE:LINE: what is wrong" per bad line


def read_prompts(path: str | Path, vocab: int, can_tokenize: bool, can_chat: bool = False) -> PromptFile:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    prompts: list[PromptLine] = []
    errors: list[str] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8", errors="strict") as handle:
        try:
            lines = handle.readlines()
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            prompt = _parse(json.loads(text), number, vocab, can_tokenize, can_chat)
            if prompt.id in seen:
                raise PromptFileError(f"duplicate id {prompt.id!r}")
            seen.add(prompt.id)
            prompts.append(prompt)
        except json.JSONDecodeError as exc:
            errors.append(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})")
        except PromptFileError as exc:
            errors.append(f"{path}:{number}: {exc}")
    if not prompts:
        detail = f"; first problem: {errors[0]}" if errors else ""
        raise PromptFileError(f"{path}: no usable prompt lines{detail}")
    return PromptFile(tuple(prompts), tuple(errors))


def _parse(obj: Any, number: int, vocab: int, can_tokenize: bool, can_chat: bool) -> PromptLine:
    if not isinstance(obj, dict):
        raise PromptFileError(f"expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise PromptFileError('missing "id"')
    ident = obj["id"]
    if not isinstance(ident, str | int) or isinstance(ident, bool):
        raise PromptFileError('"id" must be a string or an integer')
    given = [key for key in ("prompt", "input_ids", "messages") if key in obj]
    if len(given) != 1:
        raise PromptFileError('give exactly one of "prompt" and "input_ids" (or "messages")')
    if given[0] == "prompt":
        return PromptLine(str(ident), number, _text(obj["prompt"], can_tokenize), None)
    if given[0] == "messages":
        return PromptLine(str(ident), number, None, None, _messages(obj["messages"], can_chat))
    return PromptLine(str(ident), number, None, _ids(obj["input_ids"], vocab))


def _text(value: Any, can_tokenize: bool) -> str:
    if not isinstance(value, str) or not value:
        raise PromptFileError('"prompt" must be a non-empty string')
    if not can_tokenize:
        raise PromptFileError('"prompt" needs a tokenizer.json beside the model; give "input_ids" instead')
    return value


def _ids(value: Any, vocab: int) -> tuple[int, ...]:
    valid: Callable[[Any], bool] = lambda t: isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab  # noqa: E731
    if not isinstance(value, list) or not value:
        raise PromptFileError('"input_ids" must be a non-empty list of token ids')
    bad = [t for t in value if not valid(t)]
    if bad:
        raise PromptFileError(f'"input_ids" holds {bad[0]!r}, not a token id in [0, {vocab})')
    return tuple(value)


def _messages(value: Any, can_chat: bool) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise PromptFileError('"messages" must be a non-empty list of {"role": ..., "content": ...}')
    for position, message in enumerate(value):
        if not (isinstance(message, dict) and set(message) == {"role", "content"}
                and all(isinstance(v, str) for v in message.values())):  # fmt: skip
            raise PromptFileError(f'"messages"[{position}] must be {{"role": "...", "content": "..."}}')
    if not can_chat:
        raise PromptFileError('"messages" needs a chat template beside the model (tokenizer_config.json)')
    return tuple(value)
