"""`flowmoe trace summarize` on malformed and huge traces (issue 24, classes 6, 7 and 9): every
malformed trace is one error line naming the file (never a traceback, never negative, NaN or
infinite busy times or an empty table), names print as themselves, and a trace is read event by
event in memory that does not grow with its text."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.cli.trace import load_trace
from tests.bad_inputs.test_jobs import _error


def _span(**changes: object) -> dict:
    return {"name": "n", "ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 5, "args": {"id": 1}, **changes}


def _meta(name: str, args: object, **ids: object) -> dict:
    return {"name": name, "ph": "M", "pid": 1, "tid": 2, "args": args, **ids}


BAD = [
    ([_span(dur=-5)], "event 0 (n): dur -5 is a negative duration"),
    ([_span(ts=float("nan"))], "event 0 (n): ts nan is not a finite number"),
    ([_span(ts=float("inf"))], "ts inf is not a finite number"),
    ([_span(ts=1e308, dur=1e308)], "ts + dur is not a finite time"),
    ([_span(ts=10**400)], "is not a finite number"),
    ([_span(ts="0")], "ts is not a number"),
    ([_span(pid=[1])], "event 0 (n): pid [1] is not a number or a string"),
    ([_span(tid={"a": 1})], "tid {'a': 1} is not a number or a string"),
    ([_meta("process_name", ["x"]), _span()], 'event 0 (process_name): args must be an object with a "name"'),
    ([_meta("thread_name", "gpu"), _span()], 'event 0 (thread_name): args must be an object with a "name"'),
    ([_meta("process_name", {"name": "x"}, pid=[1]), _span()], "pid [1] is not a number or a string"),
    (
        [_meta("flowmoe_steps", {"steps": [{"start_us": 0, "end_us": 5, "weight": -1}]}), _span()],
        "malformed step",
    ),
    ([_meta("flowmoe_steps", {"steps": [{"start_us": 5, "end_us": 0}]}), _span()], "malformed step"),
    (
        [_meta("flowmoe_steps", {"steps": [{"start_us": 0, "end_us": float("nan")}]}), _span()],
        "malformed step",
    ),
    ([], 'no complete ("ph": "X") events to summarise'),
    ([_meta("process_name", {"name": "x"})], 'no complete ("ph": "X") events'),
    ([{"ph": "C", "name": "c", "ts": 0, "args": {"v": 1}}], 'no complete ("ph": "X") events'),
]


@pytest.mark.parametrize(("events", "message"), BAD)
def test_malformed_trace_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, events: list, message: str
) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert main(["trace", "summarize", str(trace)]) == 2
    error = _error(capsys)
    assert error.startswith(f"flowmoe: error: {trace}: ") and message in error, error


TEXTS = [
    (b'{"traceEvents": [' + json.dumps(_span()).encode(), "not valid JSON"),
    (b'{"traceEvents": [' + json.dumps(_span()).encode() + b"] x", "not valid JSON"),
    (b'{"traceEvents": [' + json.dumps(_span()).encode() + b"]} trailing", "text after the trace"),
    (b'{"traceEvents": [{"ts": ' + b"9" * 5000 + b"}]}", "an integer of too many digits"),
    (b"[" * 100_000, "nested too deeply"),
    (b'"a string"', "no traceEvents list; not a Chrome trace"),
    (b'{"traceEvents": 5}', "no traceEvents list"),
    (b'{"otherData": {}}', "no traceEvents list"),
    (b"\xff\xfe", "not UTF-8 text"),
    (b"", "no traceEvents list"),
    # gzipped with mtime=0: the same test ids in every process, as pytest-xdist's workers must collect
    (gzip.compress(b'{"traceEvents": []}', mtime=0)[:-6], "not a readable gzip file"),  # cut short
    (b"\x1f\x8b" + b"\x00" * 20, "not a readable gzip file"),
    (gzip.compress(b"[" * 100_000, mtime=0), "nested too deeply"),  # the same checks behind the gzip
]


@pytest.mark.parametrize(("text", "message"), TEXTS)
def test_malformed_text_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: bytes, message: str
) -> None:
    trace = tmp_path / "t.json"
    trace.write_bytes(text)
    assert main(["trace", "summarize", str(trace)]) == 2
    error = _error(capsys)
    assert error.startswith(f"flowmoe: error: {trace}: ") and message in error, error


def test_a_gzipped_trace_reads_as_its_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """GPU runs send their traces back gzipped (Perfetto opens them so): summarize reads them too."""
    text = json.dumps({"traceEvents": [_span(dur=7), _span(ts=10, dur=3, args={"id": 2})]}).encode()
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_bytes(text)
    packed.write_bytes(gzip.compress(text))
    assert main(["trace", "summarize", str(plain)]) == 0
    expected = capsys.readouterr().out
    assert main(["trace", "summarize", str(packed)]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("name", ["[red]x[/red]: run [/oops]", "[/x]", "[bold]gpu[/bold]"])
def test_names_print_as_themselves(tmp_path: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    trace = tmp_path / "t.json"
    events = [_meta("process_name", {"name": f"{name}: run"}), _meta("thread_name", {"name": name}),
              _span(args={"id": 1, "op": name})]  # fmt: skip
    trace.write_text(json.dumps(events))  # a bare array of events
    assert main(["trace", "summarize", str(trace)]) == 0
    assert name in capsys.readouterr().out


def test_events_are_read_one_at_a_time(tmp_path: Path) -> None:
    """A trace of 200k events, mostly counters and instants the summary does not read: loading it
    keeps the spans only, in far less memory than its text (the whole text parsed took 2.6 GB for
    5M events)."""
    trace = tmp_path / "t.json"
    spans, others = 2_000, 200_000
    with trace.open("w") as file:
        file.write('{"otherData": {"writer": "flowmoe"}, "traceEvents": [')
        for i in range(others):
            file.write(
                json.dumps({"name": "c", "ph": "C", "pid": 1, "ts": i, "args": {"v": i, "pad": "x" * 40}})
                + ","
            )
        file.write(
            ",".join(
                json.dumps(_span(ts=i, args={"id": i, "op": "f", "unused": [0] * 20})) for i in range(spans)
            )
        )
        file.write('], "displayTimeUnit": "ms"}')
    size = trace.stat().st_size
    tracemalloc.start()
    try:
        data = load_trace(trace)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data["traceEvents"]) == spans and data["displayTimeUnit"] == "ms"
    assert data["traceEvents"][0]["args"] == {"id": 0, "op": "f"}
    assert peak < size / 2, (peak, size)


def test_an_event_split_across_blocks_is_read_whole(tmp_path: Path) -> None:
    from flowmoe.traces import trace_file

    trace = tmp_path / "t.json"
    long = _span(name="x" * (3 * trace_file.BLOCK), ts=12345678901234)
    trace.write_text(json.dumps({"traceEvents": [_span(), long, _span(ts=7)]}))
    events = load_trace(trace)["traceEvents"]
    assert [e["ts"] for e in events] == [0, 12345678901234, 7] and len(
        events[1]["name"]
    ) == 3 * trace_file.BLOCK
