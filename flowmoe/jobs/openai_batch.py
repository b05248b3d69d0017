"""The OpenAI batch format (vLLM's `run-batch`, OpenAI's and other hosted batch APIs) as a prompt
and output format of `flowmoe run` (`--format openai`, or a first line holding a "custom_id" and
no "id": jobs/formats.py).

In, one request a line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body"}. A chat body's "messages" are rendered with the checkpoint's chat
template; a completion body's "prompt" is text (or token ids). A body's max_tokens (or
max_completion_tokens), temperature, top_p, top_k (vLLM's), seed and stop are the request's own;
what it leaves out is the run's flags (and generation_config.json). Out, one line a request:
{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": a chat.completion or
text_completion object}, "error": null}.

Three kinds of problem, as the batch APIs tell them apart:
- a request that is wrong by itself (another method or url, no messages, a value out of range, a
  conversation the template refuses, a prompt longer than the model takes) gets a line of its own,
  `"response": null, "error": {"code", "message"}`, and the others run;
- a request asking what flowmoe cannot do (n > 1, streaming, log-probabilities, tools, images,
  penalties, another model, any parameter not above) stops the run before it starts: one line
  naming the file, line and parameter, exit 2; running the rest would answer another question;
- a file that is not a batch (a line that is not a JSON object with a string "custom_id", a
  custom_id given twice) stops it too.
Ids are derived from the custom_id, so a resumed run writes the lines an uninterrupted one would;
only "created" (the second a response was made) differs between runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from flowmoe.core.errors import PromptFileError
from flowmoe.jobs.batching import BatchLimits, JobId, Request
from flowmoe.jobs.engine import Result
from flowmoe.jobs.prompts import in_vocab, json_lines, max_line_bytes
from flowmoe.jobs.sampling import SamplingParams
from flowmoe.model.chat import Message
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.tokenizer import TextCodec

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
Honoured = dict[str, tuple[int | bool | None, ...] | None]  # body key -> the values taken (None: any)
HONOURED: dict[str, Honoured] = {  # a value outside a key's tuple asks what flowmoe does not do
    CHAT: {"messages": None, "model": None, "max_tokens": None, "max_completion_tokens": None,
           "temperature": None, "top_p": None, "top_k": None, "seed": None, "stop": None, "user": None,
           "n": (1,), "stream": (False,), "logprobs": (False, None), "presence_penalty": (0,),
           "frequency_penalty": (0,)},
    COMPLETION: {"prompt": None, "model": None, "max_tokens": None, "temperature": None, "top_p": None,
                 "top_k": None, "seed": None, "stop": None, "user": None, "n": (1,), "best_of": (1, None),
                 "stream": (False,), "logprobs": (None,), "echo": (False,), "suffix": (None,),
                 "presence_penalty": (0,), "frequency_penalty": (0,)},
}  # fmt: skip


class InvalidRequest(Exception):
    """A request wrong by itself: answered with an error line, and the batch goes on."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@frozen
class BatchLine:
    """One request of a batch file, read but not yet tokenised."""

    custom_id: str
    line: int
    url: str
    body: Mapping[str, Any]


@frozen
class Answered:
    """A request that got an error line instead of a response."""

    custom_id: str
    line: int
    code: str
    message: str


@frozen
class Batch:
    requests: tuple[Request, ...]
    urls: Mapping[JobId, str]  # custom_id -> the endpoint it asked
    answered: tuple[Answered, ...]


def read_batch(path: Path, bound: int | None, model_names: tuple[str, ...]) -> list[BatchLine | Answered]:
    """Every request line in file order, each read or answered with its error; PromptFileError
    (exit 2) for a file that is not a batch or a request flowmoe cannot honour."""
    read: list[BatchLine | Answered] = []
    seen: set[str] = set()
    with json_lines(path, bound) as lines:
        for number, line in lines:
            where = f"{path}:{number}"
            try:
                row = line()
            except PromptFileError as exc:
                raise PromptFileError(f"{where}: not an OpenAI batch request line ({exc})") from exc
            custom_id = row.get("custom_id") if isinstance(row, dict) else None
            if not isinstance(custom_id, str) or not custom_id:
                raise PromptFileError(f'{where}: not an OpenAI batch request line (no string "custom_id")')
            if custom_id in seen:
                raise PromptFileError(f"{where}: custom_id {custom_id!r} given twice; each request needs one")
            seen.add(custom_id)
            try:
                read.append(_request(row, custom_id, number, where, model_names))
            except InvalidRequest as exc:
                read.append(Answered(custom_id, number, exc.code, str(exc)))
    if not read:
        raise PromptFileError(f"{path}: no request lines")
    return read


def _request(row: dict, custom_id: str, number: int, where: str, model_names: tuple[str, ...]) -> BatchLine:
    unknown = sorted(set(row) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise InvalidRequest(f'unknown key "{unknown[0]}" (a request holds custom_id, method, url, body)')
    if row.get("method") != "POST":
        raise InvalidRequest(f'"method" must be "POST", got {_shown(row.get("method"))}')
    url = row.get("url")
    if url not in HONOURED:
        raise InvalidRequest(f'"url" must be "{CHAT}" or "{COMPLETION}", got {_shown(url)}')
    body = row.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest('"body" must be a JSON object')
    _check_honoured(body, url, where)
    model = body.get("model")
    if model is not None and model_names and model not in model_names:
        raise PromptFileError(
            f"{where}: the request asks for model {_shown(model)}; this run serves {model_names[0]!r} "
            "(--model): give that name in the batch, or run it with its model"
        )
    return BatchLine(custom_id, number, url, body)


def _check_honoured(body: dict, url: str, where: str) -> None:
    """Refuse (exit 2) a parameter flowmoe cannot honour, or a value of it that changes the output."""
    honoured = HONOURED[url]
    for key, value in body.items():
        if key not in honoured:
            raise PromptFileError(
                f'{where}: "{key}" is not something flowmoe can honour (a {url} body may hold '
                f"{', '.join(honoured)}): take it out of the batch"
            )
        allowed = honoured[key]
        if allowed is not None and not any(_same(value, a) for a in allowed):
            raise PromptFileError(
                f'{where}: "{key}": {_shown(value)} is not something flowmoe can honour (it takes only '
                f"{' or '.join(map(_shown, allowed))}): take it out of the batch"
            )
    messages = body.get("messages") if url == CHAT else None
    for position, message in enumerate(messages if isinstance(messages, list) else []):
        extra = sorted(set(message) - {"role", "content"}) if isinstance(message, dict) else []
        parts = message.get("content") if isinstance(message, dict) else None
        kinds = {p.get("type") for p in parts if isinstance(p, dict)} if isinstance(parts, list) else set()
        if extra or kinds - {"text"}:
            what = f'"{extra[0]}"' if extra else f"a {sorted(map(str, kinds - {'text'}))[0]} part"
            raise PromptFileError(
                f'{where}: "messages"[{position}] holds {what}; flowmoe renders text turns (role, content)'
            )


def _same(value: Any, allowed: int | bool | None) -> bool:
    """JSON equality: false is not 0, 1 is 1.0."""
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    return type(value) in (int, float) and value == allowed


def batch_requests(
    path: Path,
    model: MoEModel,
    codec: TextCodec,
    limits: BatchLimits,
    sampling: SamplingParams,
    model_names: tuple[str, ...],
) -> Batch:
    """The batch file's requests, tokenised, with their own settings; the lines answered with errors."""
    requests, answered = [], []
    urls: dict[JobId, str] = {}
    for index, item in enumerate(read_batch(path, max_line_bytes(model.spec.max_positions), model_names)):
        if isinstance(item, Answered):
            answered.append(item)
            continue
        try:
            request = _tokenised(item, index, model, codec, sampling)
            problem = limits.problem(request)
            if problem is not None:
                raise InvalidRequest(problem, "context_length_exceeded")
            requests.append(request)
            urls[item.custom_id] = item.url
        except InvalidRequest as exc:
            answered.append(Answered(item.custom_id, item.line, exc.code, str(exc)))
        except PromptFileError as exc:  # the chat template refused it, or a token id out of range
            answered.append(Answered(item.custom_id, item.line, "invalid_request", str(exc)))
    return Batch(tuple(requests), urls, tuple(answered))


def _tokenised(
    item: BatchLine, index: int, model: MoEModel, codec: TextCodec, sampling: SamplingParams
) -> Request:
    body = item.body
    if item.url == CHAT:
        ids = in_vocab(tuple(codec.encode_chat(_messages(body.get("messages")))), model.spec.vocab)
    else:
        ids = _prompt_ids(body.get("prompt"), codec, model.spec.vocab)
    return Request(
        item.custom_id,
        ids,
        index,
        _max_tokens(body),
        _sampling(body, sampling),
        _stop(body.get("stop")),
    )


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest('"messages" must be a non-empty list of {"role": ..., "content": ...}')
    messages = []
    for position, message in enumerate(value):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (0, 0)
        if isinstance(content, list):  # text parts, joined as vLLM joins them
            texts = [p.get("text") for p in content]
            content = "\n".join(texts) if all(isinstance(t, str) for t in texts) and texts else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidRequest(f'"messages"[{position}] must be {{"role": "...", "content": "..."}}')
        messages.append({"role": role, "content": content})
    return messages


def _prompt_ids(value: Any, codec: TextCodec, vocab: int) -> tuple[int, ...]:
    """A completion's prompt: text, token ids, or a list of one of them (one prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return in_vocab(tuple(codec.encode(value)), vocab)
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return in_vocab(tuple(value), vocab, '"prompt" holds')
    raise InvalidRequest('"prompt" must be a non-empty string or list of token ids (one prompt per request)')


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    for key, value in given.items():
        if type(value) is not int or value < 1:
            raise InvalidRequest(f'"{key}" must be a positive integer, got {_shown(value)}')
    if len(set(given.values())) > 1:
        raise InvalidRequest('"max_tokens" and "max_completion_tokens" differ; give one')
    return next(iter(given.values()), None)


def _sampling(body: Mapping[str, Any], job: SamplingParams) -> SamplingParams | None:
    """The request's sampling: what its body gives over the job's; None when it gives nothing."""
    given = {key: body[key] for key in ("temperature", "top_p", "top_k", "seed") if body.get(key) is not None}
    if not given:
        return None
    temperature, top_p = given.get("temperature", 0.0), given.get("top_p", 1.0)
    if not _number(temperature) or temperature < 0:
        raise InvalidRequest(f'"temperature" must be a number >= 0, got {_shown(temperature)}')
    if not _number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f'"top_p" must be a number in (0, 1], got {_shown(top_p)}')
    top_k = given.get("top_k", 0)
    if type(top_k) is not int or top_k < -1:
        raise InvalidRequest(f'"top_k" must be an integer >= -1 (-1 or 0: no cut), got {_shown(top_k)}')
    if type(given.get("seed", 0)) is not int:
        raise InvalidRequest(f'"seed" must be an integer, got {_shown(given["seed"])}')
    return attrs.evolve(job, **{**given, **({"top_k": 0} if top_k == -1 else {})})


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _stop(value: Any) -> tuple[str, ...] | None:
    """The request's stop strings; None when it gives none (the job's --stop then applies)."""
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequest('"stop" must be a non-empty string or a list of them')
    return tuple(strings)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


@frozen
class Responses:
    """The output lines of a batch: each result as the endpoint it asked answers, each error as its line."""

    urls: Mapping[JobId, str]
    model: str  # the name the responses give
    codec: TextCodec

    def response(self, result: Result) -> dict[str, Any]:
        digest = _digest(str(result.id))
        text = result.text if result.text is not None else self.codec.decode(result.output_ids)
        chat = self.urls[result.id] == CHAT
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        generated = len(result.output_ids)
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{digest}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{**choice, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": generated,
                      "total_tokens": result.prompt_tokens + generated},
        }  # fmt: skip
        response = {"status_code": 200, "request_id": f"req_{digest}", "body": body}
        return {"id": f"batch_req_{digest}", "custom_id": result.id, "response": response, "error": None}


def error_line(answered: Answered) -> dict[str, Any]:
    """The output line of a request answered with an error."""
    error = {"code": answered.code, "message": answered.message}
    return {"id": f"batch_req_{_digest(answered.custom_id)}", "custom_id": answered.custom_id,
            "response": None, "error": error}  # fmt: skip


def _digest(custom_id: str) -> str:
    return hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()
