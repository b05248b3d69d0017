"""Prompt files: JSON Lines of {"id": ..., "prompt": "text"}, {"id": ..., "input_ids": [...]}
or {"id": ..., "messages": [{"role": ..., "content": ...}, ...]} (rendered by the chat template).

Each bad line is reported with its line number and skipped, so one typo does
not sink a job of thousands of prompts; a file with no usable line is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from attrs import frozen

from flowmoe.core.bounded_read import open_regular
from flowmoe.core.errors import PromptFileError
from flowmoe.core.jsonfile import JsonProblem, parse_json
from flowmoe.jobs.batching import JobId

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors put at the start of a file


@frozen
class PromptLine:
    id: JobId
    line: int
    prompt: str | None
    input_ids: tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None = None


@frozen
class PromptFile:
    prompts: tuple[PromptLine, ...]
    errors: tuple[str, ...]  # one "FILE:LINE: what is wrong" per bad line


LISTED_ERRORS = 100  # bad lines reported one by one; the rest are counted in one more line
BYTES_PER_POSITION = 32  # an "input_ids" entry takes <= 8 bytes, a text token rarely > 16 (x2 as \u escapes)
LINE_SLACK = 64 * 1024  # the id, the keys, a chat conversation's framing


def max_line_bytes(positions: int) -> int:
    """The longest prompt line a model of `positions` positions can take whole; longer lines are
    bad lines, refused before they are parsed or tokenised."""
    return BYTES_PER_POSITION * positions + LINE_SLACK


def read_prompts(
    path: str | Path,
    vocab: int,
    can_tokenize: bool,
    can_chat: bool = False,
    max_line_bytes: int | None = None,
) -> PromptFile:
    """Read a prompt file line by line as bytes: a line that is too long (`max_line_bytes`), not
    UTF-8, too deeply nested or otherwise not a prompt is reported and the others are read."""
    path = Path(path)
    prompts: list[PromptLine] = []
    errors: list[str] = []
    seen: set[JobId] = set()
    unlisted = 0  # bad lines past the first LISTED_ERRORS: counted, not kept
    with json_lines(path, max_line_bytes) as lines:
        for number, line in lines:
            try:
                prompt = _parse(line(), number, vocab, can_tokenize, can_chat)
                if prompt.id in seen:
                    raise PromptFileError(f"duplicate id {prompt.id!r}")
                seen.add(prompt.id)
                prompts.append(prompt)
            except PromptFileError as exc:
                unlisted += len(errors) >= LISTED_ERRORS
                if len(errors) < LISTED_ERRORS:
                    errors.append(f"{path}:{number}: {exc}")
    if not prompts:
        detail = f"; first problem: {errors[0]}" if errors else ""
        raise PromptFileError(f"{path}: no usable prompt lines{detail}")
    if unlisted:
        errors.append(f"{path}: {unlisted} more bad lines, not listed (the first {LISTED_ERRORS} are)")
    return PromptFile(tuple(prompts), tuple(errors))


@contextmanager
def json_lines(path: Path, max_line_bytes: int | None) -> Iterator[Iterator[tuple[int, Callable[[], Any]]]]:
    """(line number, its JSON value's reader) for each line of a request file that is not blank,
    read as bytes within `max_line_bytes`; the reader raises PromptFileError for a line that is too
    long, not UTF-8, not JSON, too deeply nested or not Unicode, so the caller reports it and goes on."""
    if path.is_dir():
        raise PromptFileError(f"{path}: is a folder, not a prompt file")
    if not path.exists():
        raise PromptFileError(f"{path}: prompt file not found")
    try:
        with open_regular(path, PromptFileError) as handle:
            yield _values(handle, max_line_bytes)
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read the prompt file ({exc.strerror or exc})") from exc


def _values(handle: BinaryIO, max_line_bytes: int | None) -> Iterator[tuple[int, Callable[[], Any]]]:
    for number, (raw, whole) in enumerate(_lines(handle, max_line_bytes), start=1):
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        if whole and _blank(raw):
            continue
        yield number, partial(_value, raw, whole, max_line_bytes)


def _blank(raw: bytes) -> bool:
    try:
        return not raw.decode("utf-8").strip()
    except UnicodeDecodeError:  # reported when the line is read
        return False


def _value(raw: bytes, whole: bool, max_line_bytes: int | None) -> Any:
    if not whole:
        raise PromptFileError(f"line longer than {max_line_bytes} bytes (the bound for this model)")
    return _load(_decode(raw))


def _lines(handle: BinaryIO, max_line_bytes: int | None) -> Iterator[tuple[bytes, bool]]:
    """(line, whole) for each line; a line over `max_line_bytes` is skipped to its end unread
    and given as (b"", False), so one huge line costs no memory."""
    limit = -1 if max_line_bytes is None else max_line_bytes + 2  # the line and its \r\n
    while raw := handle.readline(limit):
        if max_line_bytes is None or len(raw.rstrip(b"\r\n")) <= max_line_bytes:
            yield raw, True
            continue
        while raw and not raw.endswith(b"\n"):
            raw = handle.readline(1 << 20)
        yield b"", False


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"not UTF-8 text ({exc.reason} at byte {exc.start + 1} of the line)") from exc


def _load(text: str) -> Any:
    """One JSON line, which must hold valid Unicode (no lone surrogate from a \\u escape), each
    object's keys once and integers within Python's digit limit."""
    try:
        obj = parse_json(text, unique_keys=True)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except JsonProblem as exc:
        raise PromptFileError(str(exc)) from exc
    except RecursionError as exc:  # json.dumps of a value nested just under the parser's depth
        raise PromptFileError("JSON nested too deeply") from exc
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise PromptFileError(f"holds a lone surrogate ({bad}), which is not Unicode text") from exc
    return obj


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
        return PromptLine(ident, number, _text(obj["prompt"], can_tokenize), None)
    if given[0] == "messages":
        return PromptLine(ident, number, None, None, _messages(obj["messages"], can_chat))
    return PromptLine(ident, number, None, _ids(obj["input_ids"], vocab))


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


def in_vocab(ids: tuple[int, ...], vocab: int, source: str = "the tokenizer gives") -> tuple[int, ...]:
    """Token ids (a tokenizer's, or a request's `source`), range-checked like "input_ids" lines (a
    tokenizer may know more tokens than the model)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise PromptFileError(f"{source} id {bad}, not a token id in [0, {vocab}) (the model's vocab_size)")
    return ids


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
