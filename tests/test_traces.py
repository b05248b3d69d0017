"""Chrome traces: format checks on a real run, summary figures on a hand-made timeline, profiler names,
and Ctrl-C still leaving a valid trace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowmoe.cli import main
from flowmoe.cli.trace import stats_line
from flowmoe.cli.ui import NO_GPU
from flowmoe.core.executor import Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.traces.chrome import EMULATED, chrome_trace, validate_chrome
from flowmoe.traces.summary import summarize
from flowmoe.traces.trace import CounterSample, Trace

PROMPTS = Path(__file__).parent.parent / "examples" / "prompts.jsonl"


def _span(
    i: int, lane: Lane, start: float, end: float, deps=(), queued: float = 0.0, op: Op = Op.GATE
) -> Span:
    return Span(TaskNode(i, op, lane, layer=0, mb=0, deps=deps), start, end, queued)


def test_summary_of_a_hand_made_timeline() -> None:
    """gpu: [0,2] [3,5]; h2d: [0,4]; node 2 waits for the copy (dep) from 2 to 3 although queued at 0."""
    spans = [
        _span(0, Lane.GPU_COMPUTE, 0.0, 2.0, op=Op.PRE_ATTN),
        _span(1, Lane.GPU_H2D, 0.0, 3.0, op=Op.PAGE_COPY),
        _span(2, Lane.GPU_COMPUTE, 3.0, 5.0, deps=(0, 1), op=Op.EXPERT_FFN),
    ]
    (summary,) = summarize(chrome_trace([Trace(spans=spans)]))
    lanes = {lane.lane: lane for lane in summary.lanes}
    assert summary.makespan_us == pytest.approx(5e6)
    assert lanes["gpu.compute"].busy_us == pytest.approx(4e6)
    assert lanes["gpu.compute"].utilisation == pytest.approx(0.8)
    assert lanes["gpu.compute"].bubble_us == pytest.approx(1e6)
    assert lanes["gpu.h2d"].bubble_us == 0
    assert [r.id for r in summary.critical_path] == [1, 2]
    assert summary.critical_by_op() == {"page_copy": pytest.approx(3e6), "expert_ffn": pytest.approx(2e6)}


def test_launch_times_of_device_timed_spans_reach_the_summary() -> None:
    """A CUDA span (device-timed) carries its launch's host time: the trace keeps it in the node's
    args, the lane's stats add it up, and the summary line says it per step."""
    spans = [
        Span(TaskNode(0, Op.PRE_ATTN, Lane.GPU_COMPUTE, layer=0, mb=0), 0.0, 2.0, 0.0, launch=0.25),
        Span(TaskNode(1, Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer=0, mb=0), 2.0, 3.0, 0.0, launch=0.5),
        _span(2, Lane.CPU_COMPUTE, 0.0, 1.0, op=Op.CPU_ATTN),
    ]
    data = chrome_trace([Trace(spans=spans)])
    args = {e["args"]["id"]: e["args"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert args[0]["launch_us"] == pytest.approx(0.25e6) and "launch_us" not in args[2]
    (summary,) = summarize(json.loads(json.dumps(data)))
    lanes = {lane.lane: lane for lane in summary.lanes}
    assert (
        lanes["gpu.compute"].launch_seconds == pytest.approx(0.75)
        and lanes["cpu.compute"].launch_seconds is None
    )
    assert "launching threads in launches, ms/step: gpu.compute 750.00" in stats_line(summary.stats)


def test_format_of_a_real_run(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    out = tmp_path / "o.jsonl"
    assert main(["run", "--prompts", str(PROMPTS), "--output", str(out), "--max-new-tokens", "3",
                 "--micro-batches", "2", "--trace", str(trace), "--scheduler", "eager"]) == 0  # fmt: skip
    data = json.loads(trace.read_text())
    assert validate_chrome(data) == []
    events = data["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["op"] for e in slices} >= {
        "embed",
        "pre_attn",
        "gpu_attn",
        "gate",
        "expert_ffn",
        "lm_head",
    }
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "gpu.compute" in threads and "cpu.compute" in threads
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"gpu memory bytes", "gpu experts resident", "kv cache bytes"} <= counters
    labels = [e["args"]["labels"] for e in events if e.get("name") == "process_labels"]
    assert labels == ([] if torch.cuda.is_available() else [EMULATED])  # no GPU: said, lanes not renamed


def test_no_gpu_is_said_by_run_and_trace_summarize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the GPU is real here")
    trace = tmp_path / "t.json"
    argv = ["run", "--prompts", str(PROMPTS), "--output", str(tmp_path / "o.jsonl"), "--max-new-tokens", "2"]
    assert main([*argv, "--trace", str(trace), "--scheduler", "eager"]) == 0
    assert NO_GPU in " ".join(capsys.readouterr().err.split())
    assert main(["trace", "summarize", str(trace)]) == 0
    assert NO_GPU in " ".join(capsys.readouterr().out.split())
    # the default here, the cpu scheduler, has no gpu.* lane to emulate: nothing to say
    assert main([*argv, "--output", str(tmp_path / "cpu.jsonl"), "--trace", str(tmp_path / "cpu.json")]) == 0
    assert NO_GPU not in " ".join(capsys.readouterr().err.split())


def test_flows_join_lanes() -> None:
    spans = [_span(0, Lane.GPU_COMPUTE, 0, 1), _span(1, Lane.GPU_D2H, 1, 2, deps=(0,))]
    counters = [CounterSample("gpu memory bytes", "gpu", 0.5, 10.0)]
    data = chrome_trace([Trace(spans=spans, counters=counters)])
    flows = [e for e in data["traceEvents"] if e["ph"] in "sf"]
    assert sorted(e["ph"] for e in flows) == ["f", "s"] and flows[0]["id"] == flows[1]["id"]
    assert validate_chrome(data) == []
    broken = {"traceEvents": [{"ph": "X", "name": "x", "ts": 0}, {"ph": "s", "id": 9}]}
    assert validate_chrome(broken) == ["event 0: X event without dur, pid, tid", "flow 9: only s"]


def test_profiler_shows_node_names(mixtral_folder: Path) -> None:
    from flowmoe.model.loading import load_model
    from tests.schedule_fixtures import run_scheduler

    model = load_model(mixtral_folder)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=every_thread
    ) as prof:
        run_scheduler(model, "eager")
    names = {event.name for event in prof.events()}
    assert "pre_attn L0 mb0" in names and "lm_head mb1" in names


def test_ctrl_c_keeps_a_valid_trace(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": "x" * (20 + i)}) + "\n" for i in range(64)))
    trace, out = tmp_path / "t.json", tmp_path / "o.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "flowmoe.cli", "run", "--prompts", str(prompts), "--output", str(out),
               "--max-new-tokens", "200", "--batch-size", "4", "--trace", str(trace)]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted; results written so far are kept" in err
    data = json.loads(trace.read_text())
    assert validate_chrome(data) == []
    assert any(e["ph"] == "X" for e in data["traceEvents"])
    lines = out.read_text().splitlines()
    assert lines and all(json.loads(line)["id"] for line in lines)
