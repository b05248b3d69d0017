"""The OpenAI batch format (issue 27, item 8): chat and completion requests give the tokens the
native format gives, with each request's own max_tokens, stop and sampling; a request wrong by
itself gets an error line and the rest run; what flowmoe cannot honour, or a file that is not a
batch, is one error line and exit 2; a killed run resumed ends with the uninterrupted output."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import PromptFileError
from flowmoe.jobs.formats import NATIVE, OPENAI, detect
from flowmoe.jobs.job import JobSpec, run_job
from flowmoe.jobs.openai_batch import Answered, read_batch
from flowmoe.model.builtin import ensure_builtin
from flowmoe.model.loading import load_model
from flowmoe.model.tokenizer import TextCodec
from tests.helpers import Successor
from tests.test_chat import CONVERSATIONS, TEMPLATE, _hf_tokenizer
from tests.test_job_resume import _interrupt

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in checkpoint with a chat template beside it."""
    folder = tmp_path_factory.mktemp("model") / "chat-model"
    shutil.copytree(ensure_builtin(), folder)
    _hf_tokenizer(TEMPLATE).save_pretrained(folder)
    return folder


def _request(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _write(path: Path, rows: list[dict[str, Any]] | list[str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _lines(path: Path) -> dict[str, dict[str, Any]]:
    """custom_id -> output line, each whole and its custom_id once; "created" (the clock) left out."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), "torn last line"
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert len({r["custom_id"] for r in rows}) == len(rows), "duplicate lines"
    for row in rows:
        if row["response"] is not None:
            assert isinstance(row["response"]["body"].pop("created"), int)
    return {row["custom_id"]: row for row in rows}


def test_chat_and_completions_give_the_native_tokens(model: Path, tmp_path: Path) -> None:
    """Each request as the native format runs it (greedy, 4 new tokens), cut at its own max_tokens."""
    hf = _hf_tokenizer(TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "3?"}]}]
    batch = _write(tmp_path / "batch.jsonl", [
        _request("c1", CHAT, messages=CONVERSATIONS[1], model="chat-model"),
        _request("c2", CHAT, messages=parts, max_completion_tokens=2, temperature=0),
        _request("t1", COMPLETION, prompt="Hello there", max_tokens=3, n=1, stream=False),
        _request("t2", COMPLETION, prompt=[[72, 105, 33]], max_tokens=1),
    ])  # fmt: skip
    native = _write(tmp_path / "native.jsonl", [
        {"id": "c1", "messages": CONVERSATIONS[1]},
        {"id": "c2", "messages": [{"role": "user", "content": "2+2?\n3?"}]},
        {"id": "t1", "prompt": "Hello there"},
        {"id": "t2", "input_ids": [72, 105, 33]},
    ])  # fmt: skip
    flags = ["run", "-m", str(model), "-n", "4", "-b", "4"]
    assert main([*flags, "-p", str(native), "-o", str(tmp_path / "native-out.jsonl")]) == 0
    assert main([*flags, "-p", str(batch), "-o", str(tmp_path / "out.jsonl")]) == 0  # told by its first line
    expected = {r["id"]: r for r in map(json.loads, (tmp_path / "native-out.jsonl").read_text().splitlines())}
    codec = TextCodec.from_folder(model)
    assert codec is not None
    lines = _lines(tmp_path / "out.jsonl")
    assert set(lines) == {"c1", "c2", "t1", "t2"}
    for custom_id, limit in {"c1": 4, "c2": 2, "t1": 3, "t2": 1}.items():
        line, ref = lines[custom_id], expected[custom_id]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"].startswith("req_")
        body, ids = line["response"]["body"], ref["output_ids"][:limit]
        chat = custom_id.startswith("c")
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat else "cmpl-") and body["model"] == "chat-model"
        (choice,) = body["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert choice["message"]["role"] == "assistant" if chat else "message" not in choice
        assert text == codec.decode(ids)
        assert choice["finish_reason"] == (
            ref["finish_reason"] if len(ref["output_ids"]) <= limit else "length"
        )
        usage = body["usage"]
        assert usage == {"prompt_tokens": ref["prompt_tokens"], "completion_tokens": len(ids),
                         "total_tokens": ref["prompt_tokens"] + len(ids)}  # fmt: skip
    template_ids = hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)
    assert lines["c1"]["response"]["body"]["usage"]["prompt_tokens"] == len(template_ids["input_ids"])


def test_each_request_its_own_max_tokens_stop_and_the_jobs_defaults(tmp_path: Path) -> None:
    """With a stand-in model (next token = last + 1): a body's stop and max_tokens are its own, a
    body without them takes the job's (--stop, --max-new-tokens), `"stop": []` means none."""
    folder = ensure_builtin()
    model, codec = load_model(folder), TextCodec.from_folder(folder)
    batch = _write(tmp_path / "batch.jsonl", [
        _request("own stop", COMPLETION, prompt="a", stop="d"),
        _request("own max", COMPLETION, prompt="K", max_tokens=3),
        _request("job's stop", COMPLETION, prompt="0"),
        _request("no stop", COMPLETION, prompt="0", stop=[]),
    ])  # fmt: skip
    job = JobSpec(batch, tmp_path / "out.jsonl", max_new_tokens=6, batch_size=4, stop=("45",), format=OPENAI,
                  model_names=("tiny",))  # fmt: skip
    runner = Successor()
    report = asyncio.run(run_job(job, model, codec, runner))
    assert report.requests == 4 and not report.bad_lines
    got = {k: v["response"]["body"]["choices"][0] for k, v in _lines(job.output).items()}
    assert {k: (c["text"], c["finish_reason"]) for k, c in got.items()} == {
        "own stop": ("bc", "stop"), "own max": ("LMN", "length"), "job's stop": ("123", "stop"),
        "no stop": ("123456", "length"),
    }  # fmt: skip
    assert max(runner.caches) <= 4 * (1 + 6)  # each slot holds its prompt and its own new tokens


def test_a_wrong_request_gets_an_error_line_and_the_rest_run(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    batch = _write(tmp_path / "batch.jsonl", [
        _request("good", COMPLETION, prompt="Hi", max_tokens=2),
        {**_request("get", COMPLETION, prompt="Hi"), "method": "GET"},
        _request("embed", "/v1/embeddings", input="Hi"),
        _request("no messages", CHAT),
        _request("top_p 0", CHAT, messages=CONVERSATIONS[0], top_p=0),
        _request("max 0", COMPLETION, prompt="Hi", max_tokens=0),
        _request("both max", CHAT, messages=CONVERSATIONS[0], max_tokens=2, max_completion_tokens=3),
        _request("bad turn", CHAT, messages=[{"role": "assistant", "content": "me first"}]),
        _request("too long", COMPLETION, prompt="x" * 5000),
        _request("big id", COMPLETION, prompt=[5, 999]),
        {**_request("extra", COMPLETION, prompt="Hi"), "priority": 1},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(["run", "-m", str(model), "-p", str(batch), "-o", str(out), "--format", "openai"]) == 0
    lines = _lines(out)
    assert lines["good"]["error"] is None and lines["good"]["response"]["status_code"] == 200
    errors = {k: (v["error"]["code"], v["error"]["message"]) for k, v in lines.items() if k != "good"}
    assert all(lines[k]["response"] is None for k in errors)
    expected = {
        "get": ("invalid_request", '"method" must be "POST", got "GET"'),
        "embed": ("invalid_request", '"url" must be "/v1/chat/completions" or "/v1/completions"'),
        "no messages": ("invalid_request", '"messages" must be a non-empty list'),
        "top_p 0": ("invalid_request", '"top_p" must be a number in (0, 1], got 0'),
        "max 0": ("invalid_request", '"max_tokens" must be a positive integer, got 0'),
        "both max": ("invalid_request", '"max_tokens" and "max_completion_tokens" differ'),
        "bad turn": ("invalid_request", "Conversation roles must alternate"),
        "too long": ("context_length_exceeded", "exceed the model's 4096 positions"),
        "big id": ("invalid_request", '"prompt" holds id 999, not a token id in [0, 259)'),
        "extra": ("invalid_request", 'unknown key "priority"'),
    }
    assert set(errors) == set(expected)
    for custom_id, (code, message) in expected.items():
        assert errors[custom_id][0] == code and message in errors[custom_id][1], custom_id
    err = capsys.readouterr().err.replace("\n", "")
    assert f"{batch}:2: request 'get': \"method\" must be" in err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not an OpenAI batch request line (not valid JSON"),
        ('["a list"]', 'not an OpenAI batch request line (no string "custom_id")'),
        (json.dumps({"method": "POST", "url": CHAT, "body": {}}), 'no string "custom_id"'),
        (json.dumps(_request("a", COMPLETION, prompt="again")), "custom_id 'a' given twice"),
        (json.dumps(_request("b", COMPLETION, prompt="x", n=2)), '"n": 2 is not something flowmoe'),
        (json.dumps(_request("b", COMPLETION, prompt="x", stream=True)), '"stream": true is not something'),
        (json.dumps(_request("b", CHAT, messages=CONVERSATIONS[0], logprobs=True)), '"logprobs": true'),
        (json.dumps(_request("b", CHAT, messages=CONVERSATIONS[0], tools=[])), '"tools" is not something'),
        (json.dumps(_request("b", CHAT, messages=CONVERSATIONS[0], presence_penalty=0.5)), "penalty"),
        (json.dumps(_request("b", COMPLETION, prompt="x", model="gpt-4o")),
         "the request asks for model \"gpt-4o\"; this run serves 'tiny'"),
        (json.dumps(_request("b", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
         '"messages"[0] holds a image_url part'),
        (json.dumps(_request("b", CHAT, messages=[{"role": "user", "content": "x", "name": "me"}])),
         '"messages"[0] holds "name"'),
    ],
)  # fmt: skip
def test_what_flowmoe_cannot_honour_or_read_stops_the_batch(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path / "batch.jsonl", [json.dumps(_request("a", COMPLETION, prompt="x")), line])
    with pytest.raises(PromptFileError) as caught:
        read_batch(path, None, ("tiny", "folder"))
    assert str(caught.value).startswith(f"{path}:2: ") and message in str(caught.value)


def test_read_batch_keeps_file_order_and_the_honoured_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path / "batch.jsonl", [
        _request("x", COMPLETION, prompt="x", n=1, best_of=None, echo=False, model="folder", logprobs=None),
        {**_request("y", COMPLETION, prompt="x"), "method": "PUT"},
        _request("z", CHAT, messages=CONVERSATIONS[0], frequency_penalty=0.0, user="me"),
    ])  # fmt: skip
    read = read_batch(path, None, ("tiny", "folder"))
    assert [r.custom_id for r in read] == ["x", "y", "z"]
    assert isinstance(read[1], Answered) and not isinstance(read[0], Answered) and read[1].line == 2


def test_a_batch_it_cannot_run_is_one_line_and_exit_2(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    batch = _write(tmp_path / "batch.jsonl", [_request("a", COMPLETION, prompt="x", n=3)])
    out = tmp_path / "out.jsonl"
    assert main(["run", "-m", str(model), "-p", str(batch), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f'flowmoe: error: {batch}:1: "n": 3 is not something flowmoe can honour')
    assert not out.exists()


def test_the_format_follows_the_first_line_and_outputs_are_not_mixed(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    batch = _write(tmp_path / "batch.jsonl", ["", json.dumps(_request("a", COMPLETION, prompt="x"))])
    native = _write(tmp_path / "native.jsonl", ['{"id": "a", "prompt": "x", "custom_id": 1}'])
    assert (detect(batch), detect(native), detect(tmp_path / "missing")) == (OPENAI, NATIVE, NATIVE)
    out = tmp_path / "out.jsonl"
    args = ["run", "-m", str(model), "-n", "2", "-o", str(out)]
    assert main([*args, "-p", str(tmp_path / "batch.jsonl"), "--format", "flowmoe"]) == 2
    assert "no usable prompt lines; first problem: " in capsys.readouterr().err
    _write(native, ['{"id": "a", "prompt": "x"}'])
    assert main([*args, "-p", str(native)]) == 0
    assert main([*args, "-p", str(batch)]) == 2  # an OpenAI batch resumed into a native log
    assert "existing file is not a flowmoe OpenAI batch output" in capsys.readouterr().err


def _resume_batch(path: Path) -> Path:
    """120 requests, chat and completions, sampled with seeds of their own, with two wrong ones."""
    rows: list[dict[str, Any]] = []
    for i in range(120):
        sampling = {"temperature": 0.8, "seed": i % 7, "max_tokens": 1 + i % 6}
        if i % 3:
            rows.append(_request(f"r{i}", COMPLETION, prompt=" ".join(["token"] * (1 + i % 9)), **sampling))
        else:
            rows.append(_request(f"r{i}", CHAT, messages=CONVERSATIONS[i % 3], **sampling))
    rows[40]["body"]["top_p"] = 2
    rows[80]["method"] = "GET"
    return _write(path, rows)


def test_killed_and_resumed_gives_the_uninterrupted_output(model: Path, tmp_path: Path) -> None:
    batch = _resume_batch(tmp_path / "batch.jsonl")
    args = ["run", "-m", str(model), "-p", str(batch), "-b", "8", "--micro-batches", "2"]
    reference = tmp_path / "reference.jsonl"
    assert main([*args, "-o", str(reference)]) == 0
    expected = _lines(reference)
    assert len(expected) == 120 and sum(line["error"] is not None for line in expected.values()) == 2
    out = tmp_path / "out.jsonl"
    assert _interrupt([*args, "-o", str(out)], out, 50, signal.SIGKILL) == -signal.SIGKILL
    assert 50 <= len(out.read_bytes().splitlines()) < 120
    with out.open("ab") as handle:  # as if the kill had landed in the middle of a write
        handle.write(b'{"id": "batch_req_0123", "custom_id": "r1')
    assert main([*args, "-o", str(out)]) == 0
    assert _lines(out) == expected


def test_a_cached_snapshot_is_served_by_its_repo_id(tmp_path: Path) -> None:
    from flowmoe.cli.run import model_names

    snapshot = tmp_path / "hub" / "models--acme--tiny-moe" / "snapshots" / "0123abc"
    assert model_names(str(snapshot)) == ("acme/tiny-moe", "0123abc", str(snapshot))
    assert model_names(str(tmp_path / "hub" / "models--gpt2" / "snapshots" / "9f"))[0] == "gpt2"
    assert model_names(str(tmp_path / "chat-model")) == ("chat-model", str(tmp_path / "chat-model"))
