"""Bad inputs to a job, through the command line: a file flowmoe did not write is never modified, a
bad prompt line is reported with its number while the rest of the job runs, and every other error
is one `flowmoe: error:` line with exit 2 that leaves the results written so far whole and resumable."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from flowmoe.cli import main
from flowmoe.jobs import joblog
from flowmoe.jobs import prompts as prompts_module
from flowmoe.jobs.joblog import JobLog, holder_file
from flowmoe.model.builtin import ensure_builtin

GOOD = [{"id": "a", "prompt": "the experts"}, {"id": "c", "input_ids": [5, 6, 7]}]
RESULT = b'{"id": "a", "output_ids": [1], "text": "x", "finish_reason": "length", "prompt_tokens": 2}\n'


def _prompts(folder: Path, *lines: bytes, name: str = "prompts.jsonl") -> Path:
    path = folder / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _good(row: dict) -> bytes:
    return json.dumps(row).encode()


def _run(prompts: Path, out: Path, *extra: str) -> int:
    return main(["run", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "3", *extra])


def _error(capsys: pytest.CaptureFixture) -> str:
    """The one error line of a failed run (no traceback, no second error)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("flowmoe: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def _rows(path: Path) -> dict:
    """id (as JSON text, so 7 and "7" differ) -> result; every line whole and its id unique."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "torn last line"
    rows = [json.loads(line) for line in data.splitlines()]
    keys = [json.dumps(row["id"]) for row in rows]
    assert len(keys) == len(set(keys)), "duplicate results"
    return {key: (row["output_ids"], row["text"]) for key, row in zip(keys, rows, strict=True)}


@pytest.fixture
def good_prompts(tmp_path: Path) -> Path:
    return _prompts(tmp_path, *map(_good, GOOD))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The results of GOOD (and of "b", a third prompt) in an uninterrupted run."""
    folder = tmp_path_factory.mktemp("reference")
    prompts = _prompts(folder, *map(_good, [*GOOD, {"id": "b", "prompt": "route each token"}]))
    assert _run(prompts, folder / "out.jsonl") == 0
    return _rows(folder / "out.jsonl")


# ---- data loss: an --output that is not ours, the prompt file itself, a second writer


@pytest.mark.parametrize(
    "content",
    [
        b"notes\nimportant",  # the case: once cut to b"notes\n"
        b"notes\n",
        b"important",
        b'{"id": "a", "prompt": "a prompt file, not results"}\n',
        RESULT + b"a note after a result\n",
        RESULT + b"PS: a torn-looking note",
        b'{"id": null, "output_ids": [], "finish_reason": "stop"}\n',  # null is no id we write
        b'{"id": true, "output_ids": [], "finish_reason": "stop"}\n',
        b"\xff\xfe\x00binary\n",
        b"[" * 100_000 + b"\n",
    ],
)
def test_output_that_is_not_a_results_log_is_left_untouched(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture, content: bytes
) -> None:
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    assert _run(good_prompts, out) == 2
    assert "existing file is not a flowmoe results log" in _error(capsys)
    assert out.read_bytes() == content
    assert not holder_file(out).exists()


def test_output_is_checked_before_the_model_loads(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "notes.txt"
    out.write_bytes(b"notes\n")
    assert _run(good_prompts, out, "--model", str(tmp_path / "no-such-model")) == 2
    assert "existing file is not a flowmoe results log" in _error(capsys)
    assert _run(good_prompts, tmp_path / "new.jsonl", "--model", str(tmp_path / "no-such-model")) == 2
    assert "no-such-model" in _error(capsys) and not (tmp_path / "new.jsonl").exists()


def test_torn_tail_of_a_results_log_is_cut(good_prompts: Path, tmp_path: Path, reference: dict) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "c", "output_i')  # killed in the middle of the first write
    assert _run(good_prompts, out) == 0
    assert _rows(out) == {k: v for k, v in reference.items() if k != '"b"'}


@pytest.mark.parametrize(
    "spelling",
    [
        lambda p: p,
        lambda p: p.parent / ".." / p.parent.name / "." / p.name,
        lambda p: _link(p, os.symlink),
        lambda p: _link(p, os.link),
    ],
    ids=["same path", "other spelling", "symlink", "hard link"],
)
def test_output_that_is_the_prompt_file_is_refused(
    good_prompts: Path, capsys: pytest.CaptureFixture, spelling: Callable[[Path], Path]
) -> None:
    before = good_prompts.read_bytes()
    out = spelling(good_prompts)
    assert _run(good_prompts, out) == 2
    assert "is the prompt file" in _error(capsys)
    assert good_prompts.read_bytes() == before and out.read_bytes() == before


def _link(path: Path, make: Callable[[Path, Path], None]) -> Path:
    link = path.with_name("link.jsonl")
    make(path, link)
    return link


def test_second_writer_is_refused_naming_the_holder(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture, reference: dict
) -> None:
    """flock locks an open file description, so a log held open here conflicts with the run's own."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT)
    holder = JobLog.open(out)
    try:
        assert _run(good_prompts, out) == 2
        error = _error(capsys)
        assert "another flowmoe run is writing this file" in error
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in error
        assert out.read_bytes() == RESULT
    finally:
        holder.close()
    assert not holder_file(out).exists()  # the holder's sidecar goes with its lock
    assert _run(good_prompts, out) == 0
    assert _rows(out)['"c"'] == reference['"c"']


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_sidecar_flowmoe_did_not_write_is_left_alone(good_prompts: Path, tmp_path: Path, kind: str) -> None:
    """The lock's sidecar name may already be taken by a file of the user's (or a link): the run goes
    on under the lock and leaves that file byte for byte as it was; a stale sidecar of a killed run
    is flowmoe's own and is replaced."""
    out, theirs = tmp_path / "out.jsonl", tmp_path / "notes.txt"
    theirs.write_bytes(b"my notes\n")
    if kind == "file":
        holder_file(out).write_bytes(theirs.read_bytes())
    else:
        holder_file(out).symlink_to(theirs)
    assert _run(good_prompts, out) == 0
    assert holder_file(out).read_bytes() == b"my notes\n" and theirs.read_bytes() == b"my notes\n"
    assert holder_file(out).is_symlink() == (kind == "link")


def test_a_stale_sidecar_of_a_killed_run_is_replaced(good_prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    holder_file(out).write_text("pid 1 on host gone\n")
    assert _run(good_prompts, out) == 0
    assert not holder_file(out).exists()


HOLD_LOCK = """
import sys
from flowmoe.jobs.joblog import JobLog
log = JobLog.open(sys.argv[1])
print(flush=True)
input()
log.close()
"""


def test_second_process_is_refused(good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same with the lock held by another process, which the message names."""
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"  # it holds the lock
        assert _run(good_prompts, out) == 2
        assert f"(pid {holder.pid} on host {socket.gethostname()})" in _error(capsys)
    finally:
        holder.communicate(b"\n", timeout=30)
    assert holder.returncode == 0 and out.read_bytes() == b"" and not holder_file(out).exists()


# ---- bad prompt lines: reported with their number, the rest of the job runs


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"id": "b", "prompt": "caf\xe9"}', "not UTF-8 text (invalid continuation byte at byte 27"),
        (b'{"id": "b", "prompt": "' + b"x" * 10_000_000 + b'"}', "line longer than"),
        (b"[" * 100_000 + b"]" * 100_000, "line longer than 196608 bytes"),  # refused by size first
        (b"[" * 60_000 + b"]" * 60_000, "JSON nested too deeply"),
        (b'{"id": "b", "prompt": ' + b"[" * 60_000 + b"]" * 60_000 + b"}", "JSON nested too deeply"),
        (b'{"id": "\\udc00bad", "prompt": "x"}', "holds a lone surrogate (\\udc00)"),
        (b'{"id": "b", "prompt": "x\\ud800"}', "holds a lone surrogate (\\ud800)"),
    ],
    ids=[
        "invalid utf-8",
        "10 MB line",
        "nested 100k deep",
        "nested 60k deep",
        "nested in a field",
        "surrogate id",
        "surrogate text",
    ],
)
def test_bad_line_is_reported_and_the_rest_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture, reference: dict, line: bytes, message: str
) -> None:
    prompts = _prompts(tmp_path, _good(GOOD[0]), line, _good(GOOD[1]))
    out = tmp_path / "out.jsonl"
    assert _run(prompts, out) == 0
    err = capsys.readouterr().err.replace("\n", "")
    assert f"{prompts}:2: {message}" in err and "Traceback" not in err
    expected = {k: v for k, v in reference.items() if k != '"b"'}
    assert _rows(out) == expected
    assert _run(prompts, out) == 0  # and the job resumes cleanly
    assert _rows(out) == expected


class _FailingReader:
    """A prompt file whose every read fails with an I/O error."""

    def __enter__(self) -> _FailingReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def readline(self, _limit: int = -1) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def _unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path.write_text(_good(GOOD[0]).decode())
    real_open = prompts_module.open_regular

    def failing_open(where: Path, error: type) -> object:
        return _FailingReader() if where == path else real_open(where, error)

    monkeypatch.setattr(prompts_module, "open_regular", failing_open)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path, _: path, "prompt file not found"),
        (lambda path, _: path.mkdir() or path, "is a folder, not a prompt file"),
        (_unreadable, "cannot read the prompt file (Input/output error)"),
    ],
    ids=["missing", "a folder", "unreadable"],
)
def test_prompt_file_that_cannot_be_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Path, pytest.MonkeyPatch], Path],
    message: str,
) -> None:
    prompts = make(tmp_path / "prompts.jsonl", monkeypatch)
    assert _run(prompts, tmp_path / "out.jsonl") == 2
    assert f"{prompts}: {message}" in _error(capsys)


def test_byte_order_mark_is_ignored(tmp_path: Path, capsys: pytest.CaptureFixture, reference: dict) -> None:
    prompts = _prompts(tmp_path, b"\xef\xbb\xbf" + _good(GOOD[0]), _good(GOOD[1]))
    out = tmp_path / "out.jsonl"
    assert _run(prompts, out) == 0
    assert "bad prompt line" not in capsys.readouterr().err
    assert set(_rows(out)) == {'"a"', '"c"'}


# ---- ids: compared and echoed as given


def test_ids_are_compared_and_echoed_exactly(tmp_path: Path) -> None:
    """A result for 7 does not make "7" done (nor would one for null make "None"); 7 comes back as 7."""
    prompts = _prompts(tmp_path, b'{"id": 7, "input_ids": [5, 6]}', b'{"id": "7", "input_ids": [5, 6]}')
    out = tmp_path / "out.jsonl"
    done = b'{"id": 7, "output_ids": [1], "text": null, "finish_reason": "length", "prompt_tokens": 2}\n'
    out.write_bytes(done)
    assert _run(prompts, out) == 0
    data = out.read_bytes()
    assert data.startswith(done)
    assert [json.loads(line)["id"] for line in data.splitlines()] == [7, "7"]


def test_null_id_in_the_output_is_not_a_result(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = _prompts(tmp_path, b'{"id": "None", "input_ids": [5]}')
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": null, "output_ids": [1], "text": null, "finish_reason": "length"}\n')
    assert _run(prompts, out) == 2
    assert f'{out}:1: existing file is not a flowmoe results log ("id" is null)' in _error(capsys)


# ---- what the tokenizer or chat template makes of a line


def _model_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(ensure_builtin(), folder)
    return folder


EMPTY = "(rendered an empty prompt|the prompt has no tokens)"  # the chat template's check, or the job's


def test_prompt_rendering_to_nothing_is_a_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A chat template that renders a conversation to '' gives no token: a bad line, and the others'
    results are their own (once, an empty request received another request's output)."""
    model = _model_copy(tmp_path)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = lambda i, text: _good({"id": i, "messages": [{"role": "user", "content": text}]})  # noqa: E731
    both = _prompts(tmp_path, chat("a", "the experts"), chat("empty", ""), chat("c", "of a mixture"))
    out = tmp_path / "out.jsonl"
    assert _run(both, out, "--model", str(model)) == 0
    assert re.search(f"{both}:2: .*{EMPTY}", capsys.readouterr().err.replace("\n", ""))
    alone = {}
    for name, text in (("a", "the experts"), ("c", "of a mixture")):
        single = _prompts(tmp_path, chat(name, text), name=f"{name}.jsonl")
        assert _run(single, tmp_path / f"{name}.out", "--model", str(model)) == 0
        alone.update(_rows(tmp_path / f"{name}.out"))
    assert _rows(out) == alone
    only = _prompts(tmp_path, chat("empty", ""), name="only.jsonl")  # no line can run: an error, exit 2
    assert _run(only, tmp_path / "only.out", "--model", str(model)) == 2
    assert re.search(f"{only}: no prompt line can run; first problem: {only}:1: .*{EMPTY}", _error(capsys))


def test_tokenizer_larger_than_the_model_is_a_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _model_copy(tmp_path)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens(["zzzz"])  # id 259: one past the model's vocab_size
    tokenizer.save(str(model / "tokenizer.json"))
    prompts = _prompts(tmp_path, _good(GOOD[0]), _good({"id": "big", "prompt": "hi zzzz"}))
    out = tmp_path / "out.jsonl"
    assert _run(prompts, out, "--model", str(model)) == 0
    err = capsys.readouterr().err.replace("\n", "")
    assert f"{prompts}:2: the tokenizer gives id 259, not a token id in [0, 259)" in err
    assert set(_rows(out)) == {'"a"'}


# ---- non-finite weights


@pytest.mark.parametrize(
    ("tensor", "value", "where", "scheduler"),
    [
        ("model.layers.2.self_attn.o_proj.weight", float("nan"), "layer 2 (counting from 0)", "eager"),
        ("model.layers.2.self_attn.o_proj.weight", float("nan"), "layer 2 (counting from 0)", "cgopipe"),
        ("model.layers.3.input_layernorm.weight", float("inf"), "layer 3 (counting from 0)", "eager"),
        ("model.embed_tokens.weight", float("inf"), "the embedding", "eager"),
        ("lm_head.weight", float("nan"), "the final norm and lm_head", "eager"),
    ],
)
def test_non_finite_weights_fail_naming_the_layer(
    good_prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    tensor: str,
    value: float,
    where: str,
    scheduler: str,
) -> None:
    model = _model_copy(tmp_path)
    tensors = load_file(model / "model.safetensors")
    tensors[tensor] = torch.full_like(tensors[tensor], value)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out.jsonl"
    assert _run(good_prompts, out, "--model", str(model), "--scheduler", scheduler) == 2
    error = _error(capsys)
    assert "the model produced non-finite logits (NaN or Inf)" in error
    assert f"the eager re-run first produces them in {where}" in error
    assert out.read_bytes() == b""


# ---- where the output goes


def test_output_in_a_missing_folder(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "no" / "such" / "out.jsonl"
    assert _run(good_prompts, out) == 2
    assert f"folder {out.parent} does not exist" in _error(capsys)
    assert not (tmp_path / "no").exists()


def test_output_that_is_a_directory(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert _run(good_prompts, tmp_path) == 2
    assert f"--output {tmp_path}: is a directory, not a file; flowmoe writes only" in _error(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files (the simulated case runs)")
def test_read_only_output(good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT)
    out.chmod(0o444)
    assert _run(good_prompts, out) == 2
    assert "cannot open for writing (Permission denied)" in _error(capsys)
    assert out.read_bytes() == RESULT


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
        (errno.ENOSPC, "No space left on device"),
    ],
)
def test_output_that_cannot_be_opened(
    good_prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    text: str,
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if Path(path) == out:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(joblog.os, "open", refusing_open)
    assert _run(good_prompts, out) == 2
    assert f"--output {out}: cannot open for writing ({text})" in _error(capsys)
    assert out.read_bytes() == RESULT


def test_output_that_cannot_be_locked(
    good_prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without locks (ENOLCK) is one line too, not a traceback."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(joblog.fcntl, "flock", no_locks)
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT)
    assert _run(good_prompts, out) == 2
    assert f"--output {out}: cannot read or lock it (No locks available)" in _error(capsys)
    assert out.read_bytes() == RESULT


@pytest.mark.parametrize("fault", ["disk full", "short write", "fsync fails"])
def test_failed_write_keeps_the_results_so_far(
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    reference: dict,
    fault: str,
) -> None:
    """The third result cannot be written: one line, exit 2, two whole results, and a re-run resumes
    to exactly the uninterrupted output."""
    prompts = _prompts(tmp_path, *map(_good, [*GOOD, {"id": "b", "prompt": "route each token"}]))
    out = tmp_path / "out.jsonl"
    real_write, real_fsync, results = os.write, os.fsync, []

    def write(fd: int, data: bytes) -> int:
        if data.startswith(joblog.LINE_START):
            results.append(data)
            if len(results) == 3 and fault == "disk full":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if len(results) == 3 and fault == "short write":
                return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    def fsync(fd: int) -> None:
        if len(results) == 3 and fault == "fsync fails":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(joblog.os, "write", write)
    monkeypatch.setattr(joblog.os, "fsync", fsync)
    assert _run(prompts, out) == 2
    error = _error(capsys)
    assert f"{out}: cannot write a result" in error and "the 2 results written so far are kept" in error
    assert len(_rows(out)) == 2  # whole lines only: the failed one was cut off
    monkeypatch.undo()
    assert _run(prompts, out) == 0
    assert _rows(out) == reference
