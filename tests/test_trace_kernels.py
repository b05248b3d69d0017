"""--trace-kernels: the kernels that ran, merged under the GPU lanes on the trace's clock, and what
`trace summarize` reads from them (device-busy time, launch-bound nodes); without them, its header
says what a GPU span is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowmoe.cli import main
from flowmoe.cli.trace import SPANS_NOTE
from flowmoe.core.executor import Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.traces.chrome import chrome_trace, validate_chrome
from flowmoe.traces.profiler import (
    ANNOTATION,
    CLOCK_MARK,
    CPU_OP,
    Clock,
    ProfEvent,
    activity_of,
    kernel_slices,
)
from flowmoe.traces.summary import KERNEL_CAT, summarize
from flowmoe.traces.trace import KernelSlice, Trace
from flowmoe.traces.trace_file import kept

PROMPTS = Path(__file__).parent.parent / "examples" / "prompts.jsonl"
MAIN, H2D_THREAD = 11, 12  # host threads
COMPUTE_STREAM, COPY_STREAM, SIDE_STREAM, OTHER_STREAM = 7, 13, 21, 99


def _flat(text: str) -> str:
    return " ".join(text.split())


def _span(i: int, lane: Lane, start: float, end: float, queued: float, op: Op = Op.EXPERT_FFN) -> Span:
    return Span(
        TaskNode(i, op, lane, layer=0, mb=0, expert=0 if op is Op.EXPERT_FFN else -1), start, end, queued
    )


def test_clock_maps_the_profiler_onto_the_trace() -> None:
    """At each end the narrowest reading counts: marks centred at profiler 1,000 and 3,000 ns read at
    trace 10 s and 10.000004 s (a preempted, wider reading at the start is passed over): the
    profiler's clock runs 2x the trace's nanoseconds here, and 2,000 ns maps halfway."""
    marks = {
        f"{CLOCK_MARK} start 0": ProfEvent("", ANNOTATION, 900, 1100, MAIN),
        f"{CLOCK_MARK} start 1": ProfEvent("", ANNOTATION, 1900, 2100, MAIN),
        f"{CLOCK_MARK} end 0": ProfEvent("", ANNOTATION, 2900, 3100, MAIN),
    }
    readings = {
        f"{CLOCK_MARK} start 0": (10_000_000_000 - 10, 10_000_000_000 + 10),
        f"{CLOCK_MARK} start 1": (10_000_000_000, 10_000_009_000),  # preempted: not this one
        f"{CLOCK_MARK} end 0": (10_000_004_000 - 30, 10_000_004_000 + 30),
    }
    clock = Clock.from_marks(marks, readings)
    assert clock(2000) == pytest.approx(10.000002)
    assert clock.error == pytest.approx(30e-9)
    with pytest.raises(ValueError, match="no clock mark at the end"):
        Clock.from_marks({k: v for k, v in marks.items() if "end" not in k}, readings)


def test_device_events_go_to_the_node_that_launched_them() -> None:
    """Two steps of the same expert node (one label) on gpu.compute and a page copy on gpu.h2d: each
    kernel follows the CPU operation that launched it to the node range holding it on its thread,
    the range to the span of its label submitted before it; a stream takes its nodes' lane. Where the
    profiler linked no launcher, time decides: a stream none of whose kernels is linked takes the lane
    whose spans hold them, an unlinked kernel the span of its stream's lane that holds it (none
    outside every span), and a stream whose kernels no span holds no lane."""
    spans = [
        _span(0, Lane.GPU_COMPUTE, 2e-6, 20e-6, 0.0),
        _span(1, Lane.GPU_H2D, 1e-6, 30e-6, 0.0, Op.PAGE_COPY),
        _span(2, Lane.GPU_COMPUTE, 52e-6, 70e-6, 50e-6),  # the same label as node 0, a step later
    ]
    label, copy = spans[0].node.label, spans[1].node.label
    assert spans[2].node.label == label
    ns = 1000  # the profiler's nanoseconds per trace microsecond (its clock starts at the trace's 0)
    events = [
        ProfEvent(label, ANNOTATION, 1 * ns, 5 * ns, MAIN, correlation=1),
        ProfEvent("aten::mm", CPU_OP, 2 * ns, 3 * ns, MAIN, correlation=2),
        ProfEvent(copy, ANNOTATION, 1 * ns, 4 * ns, H2D_THREAD, correlation=3),
        ProfEvent("aten::copy_", CPU_OP, 2 * ns, 3 * ns, H2D_THREAD, correlation=4),
        ProfEvent(label, ANNOTATION, 51 * ns, 55 * ns, MAIN, correlation=5),
        ProfEvent("aten::mm", CPU_OP, 52 * ns, 53 * ns, MAIN, correlation=6),
        ProfEvent("gemm", "kernel", 6 * ns, 9 * ns, COMPUTE_STREAM, linked=2),
        ProfEvent("Memcpy HtoD", "gpu_memcpy", 5 * ns, 25 * ns, COPY_STREAM, linked=4),
        ProfEvent("gemm", "kernel", 60 * ns, 64 * ns, COMPUTE_STREAM, linked=6),
        ProfEvent("fill", "gpu_memset", 40 * ns, 41 * ns, COMPUTE_STREAM),  # launched outside every node
        ProfEvent("fill", "gpu_memset", 60 * ns, 61 * ns, COMPUTE_STREAM),  # unlinked, inside node 2's span
        ProfEvent("copy", "gpu_memcpy", 21 * ns, 22 * ns, SIDE_STREAM),  # unlinked, inside node 1's span
        ProfEvent("nccl", "kernel", 42 * ns, 43 * ns, OTHER_STREAM),  # unlinked, inside no span
    ]
    clock = Clock((0.0, 0.0), (1000.0, 1e-6))
    slices = kernel_slices(events, clock, spans, device=True)
    got = [(s.name, s.kind, s.lane, s.stream, s.node) for s in slices]
    assert got == [
        ("Memcpy HtoD", "memcpy", Lane.GPU_H2D, COPY_STREAM, 1),
        ("gemm", "kernel", Lane.GPU_COMPUTE, COMPUTE_STREAM, 0),
        ("copy", "memcpy", Lane.GPU_H2D, SIDE_STREAM, 1),
        ("fill", "memset", Lane.GPU_COMPUTE, COMPUTE_STREAM, None),
        ("nccl", "kernel", None, OTHER_STREAM, None),
        ("gemm", "kernel", Lane.GPU_COMPUTE, COMPUTE_STREAM, 2),
        ("fill", "memset", Lane.GPU_COMPUTE, COMPUTE_STREAM, 2),
    ]
    assert (slices[1].start, slices[1].end) == pytest.approx((6e-6, 9e-6))


def test_cpu_operations_are_the_outermost_of_each_gpu_node() -> None:
    """On the CPU: a node's outermost operations (not those they call), for GPU lanes only."""
    spans = [
        _span(0, Lane.GPU_COMPUTE, 0.0, 10e-6, 0.0),
        _span(1, Lane.CPU_COMPUTE, 10e-6, 20e-6, 0.0, Op.GATE),
    ]
    ns = 1000
    events = [
        ProfEvent(spans[0].node.label, ANNOTATION, 0, 10 * ns, MAIN),
        ProfEvent("aten::matmul", CPU_OP, 1 * ns, 5 * ns, MAIN),
        ProfEvent("aten::mm", CPU_OP, 2 * ns, 4 * ns, MAIN),  # called by matmul
        ProfEvent("aten::relu", CPU_OP, 6 * ns, 7 * ns, MAIN),
        ProfEvent("aten::add", CPU_OP, 11 * ns, 12 * ns, MAIN),  # outside every node range
        ProfEvent(spans[1].node.label, ANNOTATION, 13 * ns, 19 * ns, MAIN),
        ProfEvent("aten::mul", CPU_OP, 14 * ns, 15 * ns, MAIN),  # a cpu.compute node's: no track
    ]
    slices = kernel_slices(events, Clock((0.0, 0.0), (1000.0, 1e-6)), spans, device=False)
    assert [(s.name, s.kind, s.lane, s.node) for s in slices] == [
        ("aten::matmul", "cpu_op", Lane.GPU_COMPUTE, 0),
        ("aten::relu", "cpu_op", Lane.GPU_COMPUTE, 0),
    ]


def _kernel(
    node: int | None,
    start: float,
    end: float,
    lane: Lane | None = Lane.GPU_COMPUTE,
    stream: int = COMPUTE_STREAM,
) -> KernelSlice:
    return KernelSlice("k", "kernel", start, end, lane, stream, node)


def _synthetic() -> Trace:
    """gpu.compute: node 0 spans [0, 10] with kernels [1, 2] and [3, 4] (launch-bound: 8 wasted),
    node 1 [10, 20] with one kernel [10, 19] (not); gpu.h2d: node 2 [0, 20], one copy [0, 20]; a
    kernel on a stream no node used [30, 31]. Seconds."""
    spans = [
        _span(0, Lane.GPU_COMPUTE, 0.0, 10.0, 0.0),
        _span(1, Lane.GPU_COMPUTE, 10.0, 20.0, 0.0),
        _span(2, Lane.GPU_H2D, 0.0, 20.0, 0.0, Op.PAGE_COPY),
    ]
    kernels = [
        _kernel(0, 1.0, 2.0),
        _kernel(0, 3.0, 4.0),
        _kernel(1, 10.0, 19.0),
        _kernel(2, 0.0, 20.0, Lane.GPU_H2D, COPY_STREAM),
        _kernel(None, 30.0, 31.0, None, OTHER_STREAM),
    ]
    return Trace(spans=spans, kernels=kernels)


def test_summary_reports_device_busy_and_launch_bound_nodes() -> None:
    data = chrome_trace([_synthetic()])
    assert validate_chrome(data) == []
    tracks = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert {"gpu.compute kernels", "gpu.h2d kernels", "stream 99 kernels (no node)"} <= tracks
    (summary,) = summarize(data)
    assert {lane.lane: lane.nodes for lane in summary.lanes} == {"gpu.compute": 2, "gpu.h2d": 1}  # no kernel
    device = summary.device
    assert device is not None
    lanes = {lane.lane: lane for lane in device.lanes}
    compute = lanes["gpu.compute"]
    assert (compute.span_busy_seconds, compute.device_busy_seconds) == pytest.approx((20.0, 11.0))
    assert compute.gap_share == pytest.approx(9 / 20)
    assert compute.device_share == pytest.approx(11 / 20)  # of the makespan (the nodes')
    assert lanes["gpu.h2d"].gap_share == 0
    assert [(n.id, n.wasted_us) for n in device.launch_bound] == [(0, pytest.approx(8e6))]
    assert (device.bound_nodes, device.gpu_nodes) == (1, 3)


def test_trace_summarize_prints_the_device_or_says_what_spans_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_kernels, without = tmp_path / "k.json", tmp_path / "n.json"
    with_kernels.write_text(json.dumps(chrome_trace([_synthetic()])))
    without.write_text(json.dumps(chrome_trace([Trace(spans=_synthetic().spans)])))
    assert main(["trace", "summarize", str(with_kernels)]) == 0
    text = _flat(capsys.readouterr().out)
    assert SPANS_NOTE not in text
    assert "1 of 3 GPU nodes launch-bound" in text and "expert_ffn L0 mb0 e0" in text
    assert "45.0%" in text  # gpu.compute's launch gap share
    assert main(["trace", "summarize", str(without)]) == 0
    text = _flat(capsys.readouterr().out)
    assert SPANS_NOTE in text and "launch-bound" not in text


def test_the_reader_keeps_kernel_slices_without_their_names() -> None:
    args = {"kind": "kernel", "lane": "gpu.compute", "node": 3, "stream": 7}
    event = {"ph": "X", "name": "void gemm<...>" * 20, "cat": KERNEL_CAT, "ts": 1.0, "dur": 2.0,
             "pid": 1, "tid": 100, "args": args}  # fmt: skip
    assert kept(event) == {"ph": "X", "cat": KERNEL_CAT, "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 100,
                           "args": {"lane": "gpu.compute", "node": 3}}  # fmt: skip


def test_a_cpu_run_with_trace_kernels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real run on the CPU: a track of operations under gpu.compute, each inside the span of the
    node that ran it (to within the clock marks' reading), and `trace summarize` reads it."""
    trace = tmp_path / "t.json"
    argv = ["run", "--prompts", str(PROMPTS), "--output", str(tmp_path / "o.jsonl"), "--max-new-tokens", "2",
            "--micro-batches", "2", "--trace", str(trace), "--trace-kernels", "--device", "cpu",
            "--scheduler", "eager"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(trace.read_text())
    assert validate_chrome(data) == []
    events = data["traceEvents"]
    spans = {e["args"]["id"]: e for e in events if e["ph"] == "X" and e["cat"] != KERNEL_CAT}
    kernels = [e for e in events if e["ph"] == "X" and e["cat"] == KERNEL_CAT]
    assert kernels and all(k["args"]["lane"] == "gpu.compute" for k in kernels)
    assert {spans[k["args"]["node"]]["args"]["op"] for k in kernels} >= {"pre_attn", "gate", "expert_ffn"}
    slack_us = 5.0  # far above the marks' reading (~1 us), far below a node (~100 us and more)
    for k in kernels:
        span = spans[k["args"]["node"]]
        assert span["ts"] - slack_us <= k["ts"] and k["ts"] + k["dur"] <= span["ts"] + span["dur"] + slack_us
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {tracks[k["tid"]] for k in kernels} == {"gpu.compute ops (CPU)"}
    assert "device busy" in _flat(capsys.readouterr().err)  # run prints the device table too
    assert main(["trace", "summarize", str(trace)]) == 0
    text = _flat(capsys.readouterr().out)
    assert "GPU nodes launch-bound" in text and SPANS_NOTE not in text


def test_trace_kernels_needs_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--prompts", str(PROMPTS), "--output", str(tmp_path / "o.jsonl"), "--trace-kernels"]
    assert main(argv) == 2
    assert "give --trace FILE as well" in _flat(capsys.readouterr().err)


class _Torch211Event:
    """torch 2.11's profiler event, as the H200 run met it: no `activity_type` (`is_user_annotation`
    present where `annotated` is given)."""

    def __init__(self, name: str, device: str, annotated: bool | None = None) -> None:
        self._name, self._device = name, device
        if annotated is not None:
            self.is_user_annotation = lambda: annotated

    def name(self) -> str:
        return self._name

    def device_type(self) -> object:
        return getattr(torch.autograd.DeviceType, self._device)


@pytest.mark.parametrize(
    ("event", "activity"),
    [
        (_Torch211Event("void gemv_kernel<float>(...)", "CUDA"), "kernel"),
        (_Torch211Event("Memcpy HtoD (Pinned -> Device)", "CUDA"), "gpu_memcpy"),
        (_Torch211Event("Memset (Device)", "CUDA"), "gpu_memset"),
        (_Torch211Event("expert_ffn L0 mb0 e1", "CPU", annotated=True), ANNOTATION),
        (_Torch211Event("aten::mm", "CPU", annotated=False), CPU_OP),
        (_Torch211Event("pre_attn L1 mb0", "CPU"), ANNOTATION),
        (_Torch211Event("aten::addmm", "CPU"), CPU_OP),
    ],
)
def test_events_without_an_activity_type_are_told_apart(event: _Torch211Event, activity: str) -> None:
    assert activity_of(event) == activity
