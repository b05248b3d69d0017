"""A 200-prompt job killed halfway (SIGKILL, or Ctrl-C) and re-run ends with exactly the output of
an uninterrupted run: nothing lost, nothing duplicated, no torn line; bad lines are reported."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.cli.run import kv_budget_tokens
from flowmoe.core.errors import FlowmoeError
from flowmoe.jobs.job import JobSpec, run_job
from flowmoe.model.builtin import ensure_builtin
from flowmoe.model.loading import load_model
from flowmoe.model.tokenizer import TextCodec
from tests.helpers import Successor

WORDS = ("the", "experts", "of", "a", "mixture", "route", "each", "token", "to", "two", "feed")  # fmt: skip
BAD_LINES = {  # line number -> (text, what the report says)
    17: ("{not json", "not valid JSON"),
    60: ('{"prompt": "no id"}', 'missing "id"'),
    121: ('{"id": "p3", "prompt": "a second p3"}', "duplicate id 'p3'"),
    180: ('{"id": "big", "input_ids": [5, 999]}', '"input_ids" holds 999'),
}


def _prompt_file(path: Path) -> Path:
    """200 good prompts of mixed lengths (text and token ids), with bad lines among them."""
    rng, lines, good = random.Random(3), [], 0
    while good < 200:
        if len(lines) + 1 in BAD_LINES:
            lines.append(BAD_LINES[len(lines) + 1][0])
            continue
        if good % 4 == 0:
            row = {"id": f"p{good}", "input_ids": [rng.randrange(3, 259) for _ in range(rng.randint(1, 40))]}
        else:
            row = {"id": f"p{good}", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))}
        lines.append(json.dumps(row))
        good += 1
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(prompts: Path, out: Path) -> list[str]:
    sampling = ["--temperature", "0.8", "--top-k", "40", "--seed", "11"]
    shape = ["--batch-size", "16", "--micro-batches", "2", "--max-new-tokens", "6"]
    return ["run", "--prompts", str(prompts), "--output", str(out), *shape, *sampling]


def _results(path: Path) -> dict[str, tuple]:
    """id -> result, checking every line is whole, valid and its id unique."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), "torn last line"
    rows = [json.loads(line) for line in data.decode().splitlines()]
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "duplicate results"
    return {row["id"]: (tuple(row["output_ids"]), row["text"], row["finish_reason"]) for row in rows}


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _interrupt(args: list[str], out: Path, at_lines: int, sig: signal.Signals) -> int:
    """Run the command in a subprocess and send `sig` once the output holds `at_lines` lines."""
    process = subprocess.Popen(
        [sys.executable, "-m", "flowmoe.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while process.poll() is None and _count_lines(out) < at_lines:
            time.sleep(0.002)
        assert process.poll() is None, "the job ended before it could be interrupted"
        os.kill(process.pid, sig)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    if sig == signal.SIGINT:
        assert b"interrupted; results written so far are kept" in err
    return process.returncode


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple]]:
    """The prompt file and the output of an uninterrupted run."""
    folder = tmp_path_factory.mktemp("job")
    prompts = _prompt_file(folder / "prompts.jsonl")
    out = folder / "reference.jsonl"
    assert main(_args(prompts, out)) == 0
    return prompts, _results(out)


def test_killed_and_resumed(job, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts, reference = job
    assert set(reference) == {f"p{i}" for i in range(200)}
    assert {len(out) for out, _, _ in reference.values()} <= set(range(1, 7))
    out = tmp_path / "out.jsonl"
    assert _interrupt(_args(prompts, out), out, 100, signal.SIGKILL) == -signal.SIGKILL
    done = _count_lines(out)
    assert 100 <= done < 200
    with out.open("ab") as handle:  # as if the kill had landed in the middle of a write
        handle.write(b'{"id": "p199", "output_ids": [4, 5')
    assert main(_args(prompts, out)) == 0
    assert _results(out) == reference
    err = capsys.readouterr().err.replace("\n", "")
    for number, (_, message) in BAD_LINES.items():  # reported, and the rest of the job ran
        assert f"{prompts}:{number}: {message}" in err


def test_ctrl_c_leaves_a_valid_file(job, tmp_path: Path) -> None:
    prompts, reference = job
    out = tmp_path / "out.jsonl"
    assert _interrupt(_args(prompts, out), out, 60, signal.SIGINT) == 130
    partial = _results(out)
    assert 60 <= len(partial) < 200
    assert all(reference[key] == value for key, value in partial.items())
    assert main(_args(prompts, out)) == 0
    assert _results(out) == reference


def test_kv_budget_and_stop_strings_in_a_job(tmp_path: Path) -> None:
    """A stand-in model (next token = last + 1) through run_job: stop strings cut the written text,
    a prompt too long for the KV budget is reported by line, and every cache stays in the budget."""
    folder = ensure_builtin()
    model, codec = load_model(folder), TextCodec.from_folder(folder)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"id": "abc", "prompt": "a"}, {"id": "digits", "prompt": "0"},
             {"id": "long", "prompt": "x" * 40}, {"id": "upper", "prompt": "K"}]  # fmt: skip
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    successor = Successor()

    budget = kv_budget_tokens("30", model)
    job = JobSpec(prompts, tmp_path / "out.jsonl", max_new_tokens=6, batch_size=4, micro_batches=2,
                  kv_budget=budget, stop=("de", "45"))  # fmt: skip
    report = asyncio.run(run_job(job, model, codec, successor))
    rows = {row["id"]: row for row in map(json.loads, job.output.read_text().splitlines())}
    assert (rows["abc"]["text"], rows["abc"]["finish_reason"]) == ("bc", "stop")
    assert codec.decode(rows["abc"]["output_ids"]) == "bcde"
    assert (rows["digits"]["text"], rows["digits"]["finish_reason"]) == ("123", "stop")
    assert (rows["upper"]["text"], rows["upper"]["finish_reason"]) == ("LMNOPQ", "length")
    assert "long" not in rows and len(report.bad_lines) == 1
    assert report.bad_lines[0].startswith(f"{prompts}:3: request 'long': 40 prompt + 6 new tokens exceed")
    assert successor.caches and max(successor.caches) <= 30


def test_kv_budget_flag() -> None:
    model = load_model(ensure_builtin())
    per_token = model.spec.kv_bytes_per_token
    assert kv_budget_tokens("4096", model) == 4096
    assert kv_budget_tokens("1MiB", model) == 2**20 // per_token
    with pytest.raises(FlowmoeError, match=f"--kv-budget 1KiB holds no token \\({per_token} bytes each\\)"):
        kv_budget_tokens("1KiB", model)
