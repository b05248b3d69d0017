"""A resume cannot mix experiments (issue 24, class 5), and a job that cannot run a single line
fails (class 6) while a million bad lines are one summary (class 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.jobs.provenance import RUN_FORMAT, record_file
from tests.bad_inputs.test_jobs import _error

PROMPTS = b'{"id": "a", "input_ids": [5, 6, 7]}\n{"id": "b", "input_ids": [8, 9]}\n'


def _run(model: Path, prompts: Path, out: Path, *extra: str) -> int:
    return main(["run", "--model", str(model), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "2", *extra])  # fmt: skip


@pytest.fixture
def first(tmp_path: Path, model: Path) -> tuple[Path, Path]:
    """A finished job (greedy, 2 new tokens) on the first prompt: its prompts and output."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(PROMPTS.splitlines(keepends=True)[0])
    out = tmp_path / "o.jsonl"
    assert _run(model, prompts, out) == 0
    record = json.loads(record_file(out).read_text())
    assert record["format"] == RUN_FORMAT and record["settings"]["--max-new-tokens"] == 2
    prompts.write_bytes(PROMPTS)  # one more line to run: a resume
    return prompts, out


def _config(model: Path, **changes: object) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


CHANGES = [
    (("--max-new-tokens", "3"), None, "--max-new-tokens 2, this run has 3"),
    (("--temperature", "0.5"), None, "--temperature 0.0, this run has 0.5"),
    (("--temperature", "0.5", "--top-p", "0.5"), None, "--temperature 0.0, this run has 0.5"),
    (("--seed", "7", "--temperature", "0.5"), None, "--temperature 0.0"),
    (("--stop", "x"), None, '--stop [], this run has ["x"]'),
    (("--dtype", "float16"), None, '--dtype null, this run has "float16"'),
    ((), {"rms_norm_eps": 1e-6}, "model config.json sha256"),  # another model: a 2-layer copy, another eps
    ((), {"num_hidden_layers": 2}, "model config.json sha256"),
]


@pytest.mark.parametrize(("flags", "config", "difference"), CHANGES)
def test_a_resume_with_other_settings_is_refused(
    model: Path, first: tuple[Path, Path], capsys: pytest.CaptureFixture,
    flags: tuple[str, ...], config: dict | None, difference: str,
) -> None:  # fmt: skip
    prompts, out = first
    before, record = out.read_bytes(), record_file(out).read_bytes()
    if config:
        _config(model, **config)
    capsys.readouterr()
    assert _run(model, prompts, out, *flags) == 2
    message = _error(capsys)
    assert f"--output {out}: its results were produced with {difference}" in message
    assert "use a new --output, or --force" in message
    assert out.read_bytes() == before and record_file(out).read_bytes() == record
    # --force is the way on: the job resumes and the record names the new settings
    assert _run(model, prompts, out, *flags, "--force") == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert _run(model, prompts, out, *flags) == 0  # the same settings again: a plain resume


def test_the_same_settings_resume(model: Path, first: tuple[Path, Path]) -> None:
    prompts, out = first
    assert _run(model, prompts, out) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_a_new_output_is_a_new_experiment(tmp_path: Path, model: Path, first: tuple[Path, Path]) -> None:
    prompts, _ = first
    assert _run(model, prompts, tmp_path / "other.jsonl", "--max-new-tokens", "3") == 0


def test_a_log_without_a_record_is_resumed_and_given_one(model: Path, first: tuple[Path, Path]) -> None:
    prompts, out = first
    record_file(out).unlink()
    assert _run(model, prompts, out, "--max-new-tokens", "3") == 0
    assert json.loads(record_file(out).read_text())["settings"]["--max-new-tokens"] == 3


@pytest.mark.parametrize("content", [b"my notes\n", b'{"format": "something else"}\n'])
def test_a_foreign_file_in_the_records_place_is_left_alone(
    model: Path, first: tuple[Path, Path], capsys: pytest.CaptureFixture, content: bytes
) -> None:
    prompts, out = first
    record_file(out).write_bytes(content)
    capsys.readouterr()
    assert _run(model, prompts, out) == 2
    assert str(record_file(out)) in _error(capsys)
    assert record_file(out).read_bytes() == content


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        (b'{"id": "a", "input_ids": [5, 6, 7]}\n', "3 prompt + 5000 new tokens exceed"),
        (
            b'{"id": "a", "input_ids": [5]}\n{"id": "b", "input_ids": [5, 6]}\n',
            "exceed the model's 4096 positions",
        ),
    ],
)
def test_a_job_in_which_every_line_fails_its_length_check_fails(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture, lines: bytes, problem: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(lines)
    out = tmp_path / "o.jsonl"
    assert main(["run", "--model", str(model), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "5000"]) == 2  # fmt: skip
    message = _error(capsys)
    assert f"{prompts}: no prompt line can run; first problem: {prompts}:1:" in message and problem in message


def test_many_bad_lines_are_summarised(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    from flowmoe.jobs.prompts import LISTED_ERRORS

    prompts = tmp_path / "p.jsonl"
    bad = 20_000
    prompts.write_bytes(b'{"id": "a", "input_ids": [5]}\n' + b"{oops\n" * bad)
    assert _run(model, prompts, tmp_path / "o.jsonl") == 0
    err = capsys.readouterr().err
    assert err.count("not valid JSON") <= 2 * LISTED_ERRORS  # the log's warning and the printed line
    assert (
        f"{prompts}: {bad - LISTED_ERRORS} more bad lines, not listed (the first {LISTED_ERRORS} are)" in err
    )


def test_a_long_log_is_resumed_keeping_only_ids(tmp_path: Path) -> None:
    """Resuming reads the log as a stream: what stays in memory is the ids, not the lines (a
    590 MB log is read at disk and parser speed, 20k lines stand in for it here)."""
    import tracemalloc

    from flowmoe.jobs.joblog import JobLog

    out = tmp_path / "o.jsonl"
    line = {"output_ids": list(range(200)), "text": "x" * 2000, "finish_reason": "length", "prompt_tokens": 1}
    with out.open("w") as file:
        for i in range(20_000):
            file.write(json.dumps({"id": i, **line}) + "\n")
    tracemalloc.start()
    try:
        log = JobLog.open(out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    log.close()
    assert log.done == set(range(20_000))
    assert peak < out.stat().st_size / 10, (peak, out.stat().st_size)
