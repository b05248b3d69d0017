"""`flowmoe run` end to end on the built-in model and on a transformers checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from attrs import fields_dict

from flowmoe.cli import main

PROMPTS = Path(__file__).parent.parent / "examples" / "prompts.jsonl"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_builtin_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert main(["run", "--prompts", str(PROMPTS), "--output", str(out), "--max-new-tokens", "5"]) == 0
    first = _lines(out)
    assert [r["id"] for r in first] and {r["id"] for r in first} == {"greeting", "moe", "offload", "ids"}
    assert all(len(r["output_ids"]) <= 5 and isinstance(r["text"], str) for r in first)
    assert main(["run", "--prompts", str(PROMPTS), "--output", str(out), "--max-new-tokens", "5"]) == 0
    assert _lines(out) == first  # nothing redone, nothing duplicated


def test_run_checkpoint_with_ids(tmp_path: Path, mixtral_folder: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n{"id": 2, "input_ids": [8]}\n')
    out = tmp_path / "out.jsonl"
    sampling = ["--max-new-tokens", "4", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    code = main(
        ["run", "--model", str(mixtral_folder), "--prompts", str(prompts), "--output", str(out), *sampling]
    )
    assert code == 0
    rows = _lines(out)
    assert sorted(r["id"] for r in rows) == [1, 2]  # integer ids come back as integers
    assert all(r["text"] is None for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheduler", "nope"], "unknown scheduler 'nope'; available:"),
        (["--model", "no-such-model"], "neither a checkpoint folder nor a preset"),
        (["--max-new-tokens", "0"], "argument -n/--max-new-tokens: must be an integer >= 1, got '0'"),
        (["--top-p", "0"], "argument --top-p: must be a number in (0, 1], got '0'"),
    ],
)
def test_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    out = tmp_path / "out.jsonl"
    code = main(["run", "--prompts", str(PROMPTS), "--output", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("flowmoe: error: ") and message in err[-1]
    assert not out.exists()


def test_every_scheduler_runs_from_the_cli_with_experts_offloaded(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`flowmoe run --scheduler X` for every registered X, three quarters of the experts off the GPU:
    the same outputs as eager; schedulers with a report print it; an expert cache of 8 slots where a
    scheduler takes --expert-cache-slots (an options flag is refused where it does not)."""
    from flowmoe.schedulers.registry import available

    policy = ["--weights-gpu-share", "0.25", "--micro-batches", "2"]
    outputs = {}
    for name, scheduler in available().items():
        out = tmp_path / f"{name}.jsonl"
        args = ["run", "--prompts", str(PROMPTS), "--output", str(out), "--max-new-tokens", "4"]
        takes = "expert_cache_slots" in fields_dict(scheduler.Options)
        cache = ["--expert-cache-slots", "8"] if takes else []
        assert main([*args, "--scheduler", name, *policy, *cache]) == 0
        outputs[name] = sorted((r["id"], r["output_ids"]) for r in _lines(out))
    assert all(result == outputs["eager"] for result in outputs.values())
    err = capsys.readouterr().err
    assert "pre-gated: pregate_hits" in err and "lru-cache: hits" in err
