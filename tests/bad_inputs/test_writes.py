"""Every file flowmoe writes passes one write guard (flowmoe/core/write_guard.py), through the command
line: each writing flag of each command against each target it must never touch (a file the command
reads, another of its outputs by any spelling, a FIFO, a socket, a folder, a file flowmoe did not
write) gives exit 2 and one error line naming the problem, and leaves the target as it was; a file
flowmoe wrote is replaced, and `--force` replaces a foreign file but nothing else."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.hardware import hardware, save_profile
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.spec import ModelSpec
from flowmoe.jobs.joblog import holder_file
from flowmoe.model.builtin import CONFIG as BUILTIN_CONFIG
from flowmoe.traces.chrome import CHROME_TRACE, write_chrome
from flowmoe.traces.trace import Trace

FOREIGN = b"my notes, not flowmoe's\n"


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A FIFO that blocked an open would fail the test after a minute instead of hanging the suite."""

    def expired(_signum: int, _frame: object) -> None:
        raise TimeoutError("blocked for a minute: a FIFO was opened?")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')
    return path


def _run(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--prompts", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--max-new-tokens", "2", *extra]  # fmt: skip


# A writing flag of a command: (argv for a target path and the model folder, the target's suffix,
# the words of the refusal of a foreign file).
Writer = tuple[Callable[[Path, Path, str], list[str]], str, str]
WRITERS: dict[str, Writer] = {
    "run --trace": (lambda tmp, model, t: _run(tmp, "--model", str(model), "--trace", t), ".json",
                    "not a Chrome trace flowmoe wrote"),
    "run --record-routing": (lambda tmp, model, t: _run(tmp, "--model", str(model), "--record-routing", t),
                             ".jsonl", "not a routing trace flowmoe wrote"),
    "run --output": (lambda tmp, model, t: ["run", "--prompts", str(tmp / "prompts.jsonl"), "--model",
                     str(model), "--output", t], ".jsonl", "not a flowmoe results log"),
    "simulate --trace": (lambda tmp, model, t: ["simulate", "--model", str(model), "--scheduler", "eager",
                         "--trace", t], ".json", "not a Chrome trace flowmoe wrote"),
    "compare --trace": (lambda tmp, model, t: ["compare", "--model", str(model), "--schedulers", "eager",
                        "--trace", t], ".json", "not a Chrome trace flowmoe wrote"),
    "plan --plot": (lambda tmp, model, t: ["plan", "--model", str(model), "--plot", t], ".png",
                    "not a plot flowmoe wrote"),
    "calibrate --output": (lambda tmp, model, t: ["calibrate", "--device", "cpu", "--quick", "--model",
                           str(model), "--output", t], ".json", "not a hardware profile flowmoe wrote"),
    "reproduce --plot": (lambda tmp, model, t: ["reproduce", "fiddler", "--quick", "--plot", t], ".png",
                         "not a plot flowmoe wrote"),
    "trace plot --output": (lambda tmp, model, t: ["trace", "plot", str(_existing_trace(tmp)), "--output", t],
                            ".png", "not a plot flowmoe wrote"),
}  # fmt: skip


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    """A socket bound at `path` (by its name in the folder: socket paths are short)."""
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    finally:
        os.chdir(cwd)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    (path / "inside.txt").write_bytes(FOREIGN)
    return path


def _foreign(path: Path) -> Path:
    path.write_bytes(FOREIGN)
    return path


# What every writer must refuse: (make the target at `path`, the words of the error).
TARGETS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (_fifo, "is a FIFO (named pipe), not a regular file"),
    "socket": (_socket, "is a socket, not a regular file"),
    "folder": (_folder, "is a directory|(a folder)"),
    "foreign file": (_foreign, ""),  # the writer's own words
    "dangling symlink": (lambda p: p.symlink_to(p.with_name("nowhere")) or p, "a symlink to a missing file"),
}


def _snapshot(path: Path) -> tuple:
    """What must not change: the kind of file, its inode, and its bytes (or a folder's listing)."""
    found = os.lstat(path)
    if stat.S_ISREG(found.st_mode):
        body: object = path.read_bytes()
    elif stat.S_ISDIR(found.st_mode):
        body = sorted((p.name, p.read_bytes()) for p in path.iterdir())
    elif stat.S_ISLNK(found.st_mode):
        body = os.readlink(path)
    else:
        body = None
    return stat.S_IFMT(found.st_mode), found.st_ino, found.st_nlink, body


def _one_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("flowmoe: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def _refused(argv: list[str], target: Path, words: str, capsys: pytest.CaptureFixture) -> None:
    before = _snapshot(target)
    assert main(argv) == 2
    error = _one_error(capsys)
    assert any(w in error for w in words.split("|")), error
    assert _snapshot(target) == before
    assert not list(target.parent.glob(".flowmoe-*")), "a temporary file was left behind"


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("writer", WRITERS)
def test_a_target_that_is_not_a_file_flowmoe_may_write_is_refused(
    tmp_path: Path, model: Path, prompts: Path, capsys: pytest.CaptureFixture, writer: str, kind: str,
    force: bool,
) -> None:  # fmt: skip
    argv_of, suffix, foreign_words = WRITERS[writer]
    make, words = TARGETS[kind]
    if kind == "foreign file" and force and writer != "run --output":
        pytest.skip("--force replaces a foreign file (test_force_replaces_a_foreign_file)")
    target = make(tmp_path / f"target{suffix}")
    argv = [*argv_of(tmp_path, model, str(target)), *(["--force"] if force else [])]
    _refused(argv, target, words or foreign_words, capsys)


def _link(make: Callable[[Path, Path], None]) -> Callable[[Path], Path]:
    def spell(path: Path) -> Path:
        link = path.with_name(f"link-to-{path.name}")
        make(path, link)
        return link

    return spell


SPELLINGS: dict[str, Callable[[Path], Path | str]] = {  # the tests run in the file's folder's parent
    "same path": lambda p: p,
    "./x": lambda p: f"./{p.parent.name}/./{p.name}",
    "x/../x": lambda p: f"{p.parent.name}/../{p.parent.name}/{p.name}",
    "sub/../x": lambda p: (p.parent / "sub").mkdir(exist_ok=True) or f"{p.parent.name}/sub/../{p.name}",
    "symlink": _link(os.symlink),
    "hard link": _link(os.link),
}

# two outputs of a run on one file: the one checked first names the other
SAME_OUTPUT = "is the --output file|is the --trace file|is the --record-routing file"
CHECKPOINT = "is a file of the checkpoint"
# A file the command reads or writes, and a writing flag pointed at it: (the file, argv, the words).
Clash = Callable[[Path, Path, Path], tuple[Path, list[str], str]]
CLASHES: dict[str, Clash] = {
    "run --trace = the prompt file": lambda tmp, model, p: (
        p, _run(tmp, "--model", str(model), "--trace", "{}"), "is the prompt file"),
    "run --record-routing = the prompt file": lambda tmp, model, p: (
        p, _run(tmp, "--model", str(model), "--record-routing", "{}"), "is the prompt file"),
    "run --trace = the checkpoint's config": lambda tmp, model, p: (
        model / "config.json", _run(tmp, "--model", str(model), "--trace", "{}"), CHECKPOINT),
    "run --trace = the checkpoint's shard": lambda tmp, model, p: (
        model / "model.safetensors", _run(tmp, "--model", str(model), "--trace", "{}"),
        CHECKPOINT),
    "plan --plot = the checkpoint's config": lambda tmp, model, p: (
        model / "config.json", ["plan", "--model", str(model), "--plot", "{}"], CHECKPOINT),
    "simulate --trace = the checkpoint's tokenizer": lambda tmp, model, p: (
        model / "tokenizer.json", ["simulate", "--model", str(model), "--trace", "{}"],
        CHECKPOINT),
    "calibrate --output = the checkpoint's config": lambda tmp, model, p: (
        model / "config.json", ["calibrate", "--device", "cpu", "--model", str(model), "--output", "{}"],
        CHECKPOINT),
    "run --trace = --output": lambda tmp, model, p: (
        _existing_results(tmp), _run(tmp, "--model", str(model), "--trace", "{}"), SAME_OUTPUT),
    "run --record-routing = --output": lambda tmp, model, p: (
        _existing_results(tmp), _run(tmp, "--model", str(model), "--record-routing", "{}"), SAME_OUTPUT),
    "run --record-routing = --trace": lambda tmp, model, p: (
        _existing_trace(tmp), _run(tmp, "--model", str(model), "--trace", str(tmp / "t.json"),
                                   "--record-routing", "{}"), SAME_OUTPUT),
    "run --trace = --hardware profile": lambda tmp, model, p: (
        save_profile(hardware("t4"), tmp / "hw.json"),
        _run(tmp, "--model", str(model), "--hardware", str(tmp / "hw.json"), "--trace", "{}"),
        "is the --hardware profile"),
    "trace plot --output = the trace": lambda tmp, model, p: (
        _existing_trace(tmp), ["trace", "plot", str(tmp / "t.json"), "--output", "{}"], "is a trace to plot"),
}  # fmt: skip


def _existing_results(tmp: Path) -> Path:
    out = tmp / "out.jsonl"
    out.write_bytes(b'{"id": "z", "output_ids": [1], "text": null, "finish_reason": "length"}\n')
    return out


def _existing_trace(tmp: Path) -> Path:
    return write_chrome(tmp / "t.json", [Trace()])


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("clash", CLASHES)
def test_an_output_that_is_a_file_the_command_reads_or_writes_is_refused(
    tmp_path: Path, model: Path, prompts: Path, capsys: pytest.CaptureFixture, clash: str, spelling: str,
    force: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Compared by identity, whatever the spelling; --force does not change that."""
    file, argv, words = CLASHES[clash](tmp_path, model, prompts)
    monkeypatch.chdir(file.parent.parent)
    target = SPELLINGS[spelling](file)
    argv = [str(target) if a == "{}" else a for a in argv] + (["--force"] if force else [])
    _refused(argv, file, words, capsys)


def test_outputs_not_there_yet_are_compared_by_where_they_would_be(
    tmp_path: Path, model: Path, prompts: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    argv = ["run", "--prompts", str(prompts), "--output", "o.jsonl", "--model", str(model),
            "--trace", "sub/../o.jsonl"]  # fmt: skip
    assert main(argv) == 2
    assert "--output o.jsonl: is the --trace file (sub/../o.jsonl)" in _one_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "prompts.jsonl", "sub"]


def test_a_file_flowmoe_wrote_is_replaced_and_force_replaces_a_foreign_one(
    tmp_path: Path, model: Path, prompts: Path, capsys: pytest.CaptureFixture
) -> None:
    """The README's tour: the same command with --trace run twice resumes the results and writes the
    trace again; a foreign file is replaced with --force only."""
    trace, routing = tmp_path / "run.json", tmp_path / "routing.jsonl"
    argv = _run(tmp_path, "--model", str(model), "--trace", str(trace), "--record-routing", str(routing))
    assert main(argv) == 0
    first = trace.read_bytes()
    assert first.startswith(CHROME_TRACE.marker) and json.loads(first)["traceEvents"]
    assert main(argv) == 0  # resumed: nothing ran, both records written again over flowmoe's own
    assert json.loads(trace.read_bytes())["traceEvents"] is not None
    assert RoutingTrace.load(routing).shape is not None
    trace.write_bytes(FOREIGN)
    capsys.readouterr()
    assert main(argv) == 2 and "pass --force to replace it" in _one_error(capsys)
    assert trace.read_bytes() == FOREIGN
    assert main([*argv, "--force"]) == 0
    assert trace.read_bytes().startswith(CHROME_TRACE.marker)


def test_a_symlink_to_a_trace_flowmoe_wrote_is_written_through(
    tmp_path: Path, model: Path, prompts: Path
) -> None:
    real = write_chrome(tmp_path / "real.json", [Trace()])
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main(_run(tmp_path, "--model", str(model), "--trace", str(link))) == 0
    assert link.is_symlink() and json.loads(real.read_bytes())["traceEvents"]


@pytest.mark.parametrize(
    "write",
    [
        lambda path: write_chrome(path, [Trace()]),
        lambda path: save_profile(hardware("t4"), path),
        lambda path: RoutingTrace.for_model(ModelSpec.from_hf(BUILTIN_CONFIG)).save(path),
    ],
    ids=["trace", "hardware profile", "routing trace"],
)
def test_each_kind_knows_its_own_files_by_their_marker(tmp_path: Path, write: Callable) -> None:
    """Written twice: the second write recognises the first; a foreign file is refused."""
    path = tmp_path / "out.json"
    write(path)
    write(path)
    path.write_bytes(FOREIGN)
    with pytest.raises(FlowmoeError, match="pass --force to replace it"):
        write(path)
    assert path.read_bytes() == FOREIGN


def test_a_kind_refuses_a_file_of_another_kind(tmp_path: Path) -> None:
    trace = write_chrome(tmp_path / "t.json", [Trace()])
    before = trace.read_bytes()
    with pytest.raises(FlowmoeError, match="not a hardware profile flowmoe wrote"):
        save_profile(hardware("t4"), trace)
    assert trace.read_bytes() == before


def test_plots_carry_the_marker(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    """A plot flowmoe wrote is replaced by the next one (png and svg keep the marker in their metadata)."""
    for name in ("roof.png", "roof.svg"):
        argv = ["plan", "--model", str(model), "--plot", str(tmp_path / name)]
        assert main(argv) == 0
        assert main(argv) == 0


# ---- resuming never cuts what flowmoe did not half-write

RESULT = b'{"id": "z", "output_ids": [1], "text": "x", "finish_reason": "length", "prompt_tokens": 2}\n'


@pytest.mark.parametrize(
    "tail",
    [
        b'{"id": "mine", "note": "a whole line of mine, only its newline missing"}',
        b'{"id": "big", "data": "' + b"x" * 1_000_000 + b'"}',
        b'{"id": 1, "output_ids": [2], "finish_reason": "stop"} and a note after it',
        b'{"id": "tab", "text": "a raw\ttab"',
        b'{"id": "binary", "text": "\xff\xfe"',
    ],
    ids=["whole foreign line", "1 MB foreign line", "result then text", "raw control char", "not utf-8"],
)
def test_a_last_line_flowmoe_did_not_half_write_is_never_cut(
    tmp_path: Path, model: Path, prompts: Path, capsys: pytest.CaptureFixture, tail: bytes
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT + tail)
    assert main(_run(tmp_path, "--model", str(model))) == 2
    assert "existing file is not a flowmoe results log" in _one_error(capsys)
    assert out.read_bytes() == RESULT + tail


def test_a_whole_result_without_its_newline_is_kept(tmp_path: Path, model: Path, prompts: Path) -> None:
    """A result cut just before its newline is whole: the newline is added, the result kept (its
    request is not run again)."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(RESULT + RESULT.replace(b'"z"', b'"a"').rstrip(b"\n"))
    assert main(_run(tmp_path, "--model", str(model))) == 0
    assert out.read_bytes() == RESULT + RESULT.replace(b'"z"', b'"a"')


@pytest.mark.parametrize(
    "content",
    [b"pid 1 on host gone\n", b"pid 7 on host gone\nmy notes\n", b"pid " + b"9" * 5000 + b" on host x\n"],
    ids=["hard-linked holder line", "holder line then notes", "longer than a sidecar"],
)
def test_a_sidecar_that_is_a_users_file_is_never_overwritten(
    tmp_path: Path, model: Path, prompts: Path, content: bytes
) -> None:
    """A file of the user's under the sidecar's name, even one that starts like a holder line, is
    left as it is: flowmoe claims only a plain, unlinked file holding one holder line."""
    mine = tmp_path / "mine.txt"
    mine.write_bytes(content)
    os.link(mine, holder_file(tmp_path / "out.jsonl"))
    if content != b"pid 1 on host gone\n":  # the others are foreign by content alone
        mine.unlink()
        mine = holder_file(tmp_path / "out.jsonl")
    assert main(_run(tmp_path, "--model", str(model))) == 0
    assert mine.read_bytes() == content
    assert holder_file(tmp_path / "out.jsonl").read_bytes() == content
