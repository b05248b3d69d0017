"""The command line's tables at 80 columns and piped (issue 27, item 3): no cell cut with "…", no
name or number split over lines, no line past 80 columns. Each command runs through `main`; every
table it prints is rendered again at width 80 and each no-wrap cell must appear whole."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flowmoe.cli import main, ui
from flowmoe.study.reproduce.run import summary, verdicts

WIDTH = 80


def rendered(table: Table) -> str:
    console = Console(width=WIDTH, file=io.StringIO(), force_terminal=False, color_system=None)
    console.print(table)
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def assert_legible(table: Table) -> None:
    text = rendered(table)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text
    for column in table.columns:
        header = column.header if isinstance(column.header, str) else str(column.header)
        for word in header.split():
            assert word in text, (word, text)  # headers break at spaces only
        if not column.no_wrap:
            continue
        for cell in column.cells:
            plain = Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)
            assert plain in text, (plain, text)  # the whole name or number on one line


@pytest.fixture
def tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Table]]:
    """Every table the command prints (on stdout or stderr), at a width of 80 columns."""
    seen: list[Table] = []
    for console in (ui.out, ui.console):
        monkeypatch.setattr(console, "width", WIDTH)
        original = console.print

        def keep(*objects: object, _print: Callable[..., None] = original, **kwargs: Any) -> None:
            seen.extend(o for o in objects if isinstance(o, Table))
            _print(*objects, **kwargs)

        monkeypatch.setattr(console, "print", keep)
    yield seen


SMALL = ["--model", "olmoe-1b-7b", "--layers", "1", "--workload", "fixed:8:2", "--hardware", "t4",
         "--batch-size", "2", "--gpu-memory", "64GiB"]  # fmt: skip


def test_compare_every_scheduler(tables: list[Table], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", *SMALL]) == 0
    assert tables
    for table in tables:
        assert_legible(table)
    printed = capsys.readouterr()
    assert "…" not in printed.out
    from flowmoe.schedulers.registry import available

    n = len(available())
    # a line per finished scheduler, piped
    assert f"[{n}/{n}]" in printed.err or f"[{n - 1}/{n - 1}]" in printed.err

    for name in available():  # each scheduler's policy, on a line of its own
        assert f"\n{name}: N=" in printed.out


def test_simulate_one_scheduler(tables: list[Table]) -> None:
    assert main(["simulate", *SMALL, "--scheduler", "hybrimoe"]) == 0
    assert len(tables) == 3  # the results, the latency and plan's choices, and the lanes
    for table in tables:
        assert_legible(table)


@pytest.mark.parametrize("argv", [["presets"], ["schedulers"]])
def test_info_tables(argv: list[str], tables: list[Table]) -> None:
    assert main(argv) == 0
    for table in tables:
        assert_legible(table)


def test_reproduce_says_met_or_missed(tables: list[Table], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "lru-cache", "--quick"]) == 0
    for table in tables:
        assert_legible(table)
    text = capsys.readouterr().out
    assert "targets" in text and ("met" in text or "missed" in text)
    if "missed" in text:
        assert "bench/RESULTS.md" in text and "Targets missed" in text


def test_verdicts_per_target() -> None:
    rows = [{"metric": "tok/s", "published": 10.0, "simulated": 14.7, "ratio": 1.47}]
    data = summary([{"rows": rows, "speedups": [{"ratio": 1.1}], "ranking": {"holds": True}}])
    verdict = {t["target"]: t["met"] for t in data["targets"]}
    assert verdict == {
        "absolute tok/s, median off": False,
        "speedups, median off": True,
        "speedups, worst off": True,
        "rankings equal to the paper's": True,
    }
    assert verdicts({**data, "rankings": 0, "speedups": {"count": 0}}) == [data["targets"][0]]


def test_the_misses_are_accounted_for_in_results() -> None:
    from flowmoe.study.reproduce.run import MISSES_EXPLAINED

    results = Path(__file__).parents[1] / "bench" / "RESULTS.md"
    assert MISSES_EXPLAINED in results.read_text().splitlines()


def test_run_summary_and_stats(tmp_path: Path, tables: list[Table]) -> None:
    prompts = Path(__file__).parents[1] / "examples" / "prompts.jsonl"
    argv = ["run", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--max-new-tokens", "2"]
    assert main([*argv, "--trace", str(tmp_path / "t.json")]) == 0
    assert tables
    for table in tables:
        assert_legible(table)


def test_calibrate_table(tmp_path: Path, tables: list[Table], monkeypatch: pytest.MonkeyPatch) -> None:
    from flowmoe.study import calibrate as calibration

    monkeypatch.setattr(calibration, "copy_bandwidth", lambda *_args: 7.5e9)
    assert main(["calibrate", "--quick", "--device", "cpu", "--output", str(tmp_path / "hw.json")]) == 0
    (table,) = tables
    assert_legible(table)
