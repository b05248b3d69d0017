"""One set of run statistics (traces/stats.py), the same wherever it is reported; the trace file
itself (integer-nanosecond timestamps, the user's umask, any valid Chrome format)."""

from __future__ import annotations

import itertools
import json
import os
from decimal import Decimal
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.executor import Span
from flowmoe.core.hardware import hardware, save_profile
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.study.roofline_plot import plot_roofline
from flowmoe.traces.chrome import chrome_trace, write_chrome
from flowmoe.traces.stats import SpanRecord, Window, run_stats, union_us
from flowmoe.traces.summary import summarize
from flowmoe.traces.trace import StepWindow, Trace
from tests.schedule_fixtures import TINY_CONFIG


def rec(
    i: int, lane: str, op: str, start: float, end: float, layer: int = 0, expert: int = -1, nbytes: int = 0
):
    return SpanRecord(i, lane, op, op, start, end, start, (), layer, expert, nbytes)


def test_busy_time_is_the_union_of_a_lanes_intervals() -> None:
    assert union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == pytest.approx(4.0)
    stats = run_stats([rec(0, "gpu.h2d", "page_copy", 0, 2), rec(1, "gpu.h2d", "page_copy", 1, 3)])
    (lane,) = stats.lanes
    assert lane.busy_seconds == pytest.approx(3e-6) and lane.share == pytest.approx(1.0)


def test_weighted_windows_overlap_bytes_and_host_time() -> None:
    """Two steps: the second stands for three. gpu busy 2 of 4 then 3 of 5; h2d moves 100 bytes."""
    records = [
        rec(0, "gpu.compute", "gate", 0, 2), rec(1, "gpu.h2d", "page_copy", 1, 4, expert=1, nbytes=100),
        rec(2, "gpu.compute", "gate", 10, 13), rec(3, "gpu.h2d", "page_copy", 10, 11, expert=1, nbytes=100),
    ]  # fmt: skip
    windows = [Window(0, 4, 1.0, host_us=2.0), Window(10, 15, 3.0, host_us=4.0)]
    stats = run_stats(records, windows)
    lanes = {lane.lane: lane for lane in stats.lanes}
    assert stats.makespan_seconds == pytest.approx((4 + 3 * 5) * 1e-6)
    assert lanes["gpu.compute"].busy_seconds == pytest.approx((2 + 3 * 3) * 1e-6)
    assert lanes["gpu.compute"].share == pytest.approx(11 / 19)
    assert lanes["gpu.h2d"].bytes == pytest.approx(400) and lanes["gpu.h2d"].nodes == pytest.approx(4)
    assert stats.overlap == pytest.approx(19 / 11)
    assert stats.host_seconds_per_step == pytest.approx((2 + 3 * 4) / 4 * 1e-6)


def test_cache_hit_rate_and_prefetch_accuracy() -> None:
    """Experts 0 (resident) and 1 (copied) run on the GPU, 2 on the CPU; 3 is copied but unused."""
    step = [
        rec(0, "gpu.h2d", "page_copy", 0, 1, expert=1), rec(1, "gpu.h2d", "page_copy", 1, 2, expert=3),
        rec(2, "gpu.h2d", "page_copy", 2, 3, expert=-1),  # a dense part: not an expert
        rec(3, "gpu.compute", "expert_ffn", 3, 4, expert=0),
        rec(4, "gpu.compute", "expert_ffn", 4, 5, expert=1),
        rec(5, "gpu.compute", "expert_ffn", 5, 6, expert=0),  # the same expert, another micro-batch
        rec(6, "cpu.compute", "expert_ffn", 3, 6, expert=2),
    ]  # fmt: skip
    stats = run_stats(step)
    assert stats.expert_cache_hit_rate == pytest.approx(1 / 3)
    assert stats.prefetch_accuracy == pytest.approx(1 / 2)
    assert run_stats([rec(0, "gpu.compute", "gate", 0, 1)]).prefetch_accuracy is None


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


def test_compare_and_trace_summarize_agree(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare's figures (interpolated over the batch) are what summarize reads back from its trace."""
    trace = tmp_path / "c.json"
    names = ["cgopipe", "fiddler", "lru-cache"]
    code = main(["compare", "--model", tiny_model, "--workload", "fixed:6:6", "--schedulers", ",".join(names),
                 "--batch-size", "4", "--micro-batches", "2", "--decode-samples", "2", "--trace", str(trace),
                 "--json"])  # fmt: skip
    assert code == 0
    results = {r["scheduler"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    summaries = {s.group: s.stats for s in summarize(json.loads(trace.read_text()))}
    assert sorted(summaries) == names
    for name in names:
        ours, theirs = results[name]["stats"], summaries[name].to_json()
        assert ours["makespan_seconds"] == pytest.approx(
            results[name]["prefill_seconds"] + results[name]["decode_seconds"]
        )
        for key in ("makespan_seconds", "steps", "overlap", "expert_cache_hit_rate", "prefetch_accuracy"):
            expected = theirs[key] if theirs[key] is None else pytest.approx(theirs[key], rel=1e-6)
            assert ours[key] == expected, (name, key)
        for a, b in zip(ours["lanes"], theirs["lanes"], strict=True):
            assert a["lane"] == b["lane"] and a["nodes"] == b["nodes"] and a["bytes"] == b["bytes"]
            ns = 1e-9 * a["nodes"]  # the trace keeps each span to the nanosecond
            for key in ("busy_seconds", "bubble_seconds"):
                assert a[key] == pytest.approx(b[key], abs=ns), (name, a["lane"], key)
            assert a["busy_share"] == pytest.approx(b["busy_share"], abs=ns / ours["makespan_seconds"])
        table = {lane["lane"]: lane["utilisation"] for lane in results[name]["lanes"]}  # compare's table
        assert table == {lane["lane"]: lane["busy_share"] for lane in ours["lanes"]}


def _ns(value: float) -> int:
    return int(Decimal(repr(value)) * 1000)


def test_consecutive_slices_of_a_lane_never_overlap() -> None:
    """Spans a float rounding apart are written on whole nanoseconds, each slice ending at or before
    the next one's start."""
    spans, t = [], 0.1
    for i in range(200):
        end = t + 1 / 3e4 * (1 + i % 7)
        spans.append(Span(TaskNode(i, Op.GATE, Lane.GPU_COMPUTE, layer=0, mb=0), t, end))
        t = end
    slices = [e for e in chrome_trace([Trace(spans=spans)])["traceEvents"] if e["ph"] == "X"]
    ticks = [(_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in slices]
    assert all(
        Decimal(repr(e["ts"])) * 1000 % 1 == 0 and Decimal(repr(e["dur"])) * 1000 % 1 == 0 for e in slices
    )
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ticks))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_traces_images_and_profiles_get_the_users_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        trace = write_chrome(tmp_path / "t.json", [Trace(spans=[])])
        image = tmp_path / "r.png"
        plot_roofline(preset("mixtral-8x7b"), hardware("t4"), Policy(), 512, image)
        profile = save_profile(hardware("t4"), tmp_path / "hw.json")
    finally:
        os.umask(old)
    assert trace.stat().st_mode & 0o777 == 0o666 & ~umask
    assert image.stat().st_mode & 0o777 == 0o666 & ~umask
    assert profile.stat().st_mode & 0o777 == 0o666 & ~umask


def test_summarize_reads_a_bare_event_array_and_events_without_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [
        {"name": "a", "ph": "X", "ts": 0, "dur": 5},  # no pid, tid or args
        {"name": "b", "ph": "X", "ts": 5, "dur": 5, "pid": 1, "tid": 2},
        {"name": "c", "ph": "i", "ts": 1},
    ]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(events))
    assert main(["trace", "summarize", str(path)]) == 0
    assert "makespan 0.010 ms" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [("{}", "no traceEvents"), ("3", "no traceEvents"), ('[{"ph": "X", "ts": "x"}]', "ts is not a number")],
)
def test_summarize_refuses_what_is_not_a_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert main(["trace", "summarize", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_a_runs_trace_has_a_window_per_step() -> None:
    trace = Trace()
    trace.extend([Span(TaskNode(0, Op.GATE, Lane.GPU_COMPUTE, layer=0, mb=0), 1.0, 2.0)])
    trace.extend([], window=StepWindow(3.0, 4.0, 2.0))
    assert trace.steps == [StepWindow(1.0, 2.0), StepWindow(3.0, 4.0, 2.0)]


def test_a_runs_trace_carries_its_steps_and_host_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "t.json", tmp_path / "o.jsonl"
    prompts = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
    argv = ["run", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "3",
            "--scheduler", "cgopipe", "--weights-gpu-share", "0.5", "--trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().err  # the summary goes to the console (stderr)
    (summary,) = summarize(json.loads(trace.read_text()))
    stats = summary.stats
    assert stats.steps >= 3 and stats.host_seconds_per_step is not None and stats.host_seconds_per_step > 0
    assert stats.prefetch_accuracy is not None and stats.expert_cache_hit_rate is not None
    assert f"{stats.makespan_seconds * 1e3:.3f}" in printed  # run prints the same figures


def test_run_json_reports_the_statistics_summarize_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --json` prints one JSON object on stdout whose statistics are the trace's, by the same
    definitions `trace summarize` uses."""
    trace, out = tmp_path / "t.json", tmp_path / "o.jsonl"
    prompts = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
    argv = ["run", "--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "3", "--json",
            "--scheduler", "lru-cache", "--weights-gpu-share", "0.5", "--trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheduler"] == "lru-cache" and report["requests"] == len(prompts.read_text().splitlines())
    assert report["generated_tokens"] == sum(
        len(json.loads(r)["output_ids"]) for r in out.read_text().splitlines()
    )
    (summary,) = summarize(json.loads(trace.read_text()))
    theirs = summary.stats.to_json()
    for key in ("steps", "expert_cache_hit_rate", "prefetch_accuracy"):
        assert report["stats"][key] == theirs[key], key
    assert report["stats"]["makespan_seconds"] == pytest.approx(theirs["makespan_seconds"], abs=1e-6)
    assert [lane["bytes"] for lane in report["stats"]["lanes"]] == [lane["bytes"] for lane in theirs["lanes"]]
