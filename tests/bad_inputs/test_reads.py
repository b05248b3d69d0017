"""Every file flowmoe reads is a regular file read up to a bound that fits its kind
(flowmoe/core/bounded_read.py), through the command line: a FIFO in place of any input is one error
line naming it, never a hang (each case runs in a subprocess with a timeout), and a file larger than
its kind's bound is refused before it is read (sparse files: no disk is spent)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.bounded_read import CONFIG, INDEX, ROUTING, TEMPLATE, TOKENIZER, TRACE
from flowmoe.jobs.joblog import LINE_BOUND, JobLog, holder_file

FIFO = "is a FIFO (named pipe), not a regular file"
TIMEOUT = 120  # seconds: far more than any case takes; a hang fails the test, not the suite


@pytest.fixture(autouse=True)
def prompts(tmp_path: Path) -> None:
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "input_ids": [5, 6, 7]}\n')


def _run(tmp: Path, model: Path, *extra: str) -> list[str]:
    return ["run", "--model", str(model), "--prompts", str(tmp / "prompts.jsonl"), "--output",
            str(tmp / "out.jsonl"), "--max-new-tokens", "2", *extra]  # fmt: skip


def _reads(flag: str) -> Callable[[Path, Path, Path], list[str]]:
    return lambda tmp, model, file: _run(tmp, model, flag, str(file))


# Each input: (where it is under the temp folder, the command that reads it from (tmp, model, file)).
Reader = Callable[[Path, Path, Path], list[str]]
INPUTS: dict[str, tuple[str, Reader]] = {
    "config.json": ("model/config.json", lambda tmp, model, _file: _run(tmp, model)),
    "the index": ("model/model.safetensors.index.json", lambda tmp, model, _file: _run(tmp, model)),
    "a shard": ("model/model.safetensors", lambda tmp, model, _file: _run(tmp, model)),
    "tokenizer.json": ("model/tokenizer.json", lambda tmp, model, _file: _run(tmp, model)),
    "tokenizer_config.json": ("model/tokenizer_config.json", lambda tmp, model, _file: _run(tmp, model)),
    "chat_template.jinja": ("model/chat_template.jinja", lambda tmp, model, _file: _run(tmp, model)),
    "the prompt file": ("prompts.jsonl", lambda tmp, model, _file: _run(tmp, model)),
    "the output resumed": ("out.jsonl", lambda tmp, model, _file: _run(tmp, model)),
    "--routing-profile": ("routing.jsonl", _reads("--routing-profile")),
    "--hardware profile": ("hw.json", lambda tmp, model, file: ["plan", "--model", str(model), "--hardware",
                                                                  str(file)]),
    "simulate --routing": ("routing.jsonl", lambda tmp, model, file: ["simulate", "--model", str(model),
                                                                        "--routing", str(file)]),
    "trace summarize": ("t.json", lambda tmp, model, file: ["trace", "summarize", str(file)]),
}  # fmt: skip


def _input(tmp: Path, model: Path, case: str) -> tuple[Path, list[str]]:
    """The input's path (whatever was there removed) and the command that reads it."""
    where, reader = INPUTS[case]
    path = tmp / where
    if path.is_symlink() or path.exists():
        path.unlink()
    return path, reader(tmp, model, path)


def _flowmoe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowmoe.cli", *argv], capture_output=True, text=True, timeout=TIMEOUT
    )


def _one_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("flowmoe: error: ")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("case", INPUTS)
def test_a_fifo_in_place_of_an_input_is_one_error_line_not_a_hang(
    tmp_path: Path, model: Path, case: str
) -> None:
    fifo, argv = _input(tmp_path, model, case)
    os.mkfifo(fifo)
    result = _flowmoe(argv)
    assert result.returncode == 2, result.stderr
    assert f"{fifo}: {FIFO}" in _one_error(result.stderr)
    assert fifo.is_fifo()


def test_a_fifo_as_the_lock_sidecar_is_left_alone(tmp_path: Path, model: Path) -> None:
    """The run goes on under its lock without the sidecar; the FIFO stays a FIFO."""
    sidecar = holder_file(tmp_path / "out.jsonl")
    os.mkfifo(sidecar)
    result = _flowmoe(_run(tmp_path, model))
    assert result.returncode == 0, result.stderr
    assert sidecar.is_fifo() and (tmp_path / "out.jsonl").read_bytes().count(b"\n") == 1


def test_a_fifo_sidecar_of_a_held_lock_does_not_hang_the_second_run(tmp_path: Path, model: Path) -> None:
    out = tmp_path / "out.jsonl"
    holder = JobLog.open(out)  # holds the lock; the sidecar is then swapped for a FIFO
    try:
        holder_file(out).unlink()
        os.mkfifo(holder_file(out))
        result = _flowmoe(_run(tmp_path, model))
    finally:
        holder.close()
    assert holder_file(out).is_fifo()  # not the holder's sidecar any more: left where it is
    assert result.returncode == 2
    assert "another flowmoe run is writing this file (holder unknown)" in _one_error(result.stderr)


BOUNDS = {  # the inputs read whole, and the bound of each
    "config.json": CONFIG,
    "the index": INDEX,
    "tokenizer.json": TOKENIZER,
    "tokenizer_config.json": CONFIG,
    "chat_template.jinja": TEMPLATE,
    "--routing-profile": ROUTING,
    "--hardware profile": CONFIG,
    "trace summarize": TRACE,
}


@pytest.mark.parametrize("case", BOUNDS)
def test_an_input_larger_than_its_bound_is_refused_unread(
    tmp_path: Path, model: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    """One byte past the bound, in a sparse file (all zeros, no disk spent)."""
    path, argv = _input(tmp_path, model, case)
    bound = BOUNDS[case]
    with path.open("wb") as handle:
        handle.truncate(bound.limit + 1)
    assert main(argv) == 2
    error = _one_error(capsys.readouterr().err)
    assert f"{path}: larger than {bound} (the most {bound.kind} may hold); not read" in error


def test_an_output_line_longer_than_any_result_is_refused(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture
) -> None:
    """An existing --output whose first line never ends (a huge file of zeros, say) is read no
    further than the line bound, and left as it was."""
    out = tmp_path / "out.jsonl"
    with out.open("wb") as handle:
        handle.truncate(LINE_BOUND + 2**20)
    assert main(_run(tmp_path, model)) == 2
    assert "a line longer than 64 MiB" in _one_error(capsys.readouterr().err)
    assert out.stat().st_size == LINE_BOUND + 2**20
