"""Reading a Chrome trace event by event, in memory that does not grow with the file's text.

A trace of millions of events is parsed one event at a time from 1 MiB blocks (the standard JSON
decoder's `raw_decode` on a sliding window), and each event is kept only as far as the summary
reads it: complete ("X") events with their times, ids and placement (a kernel track's slices
without their names, which can be long and the summary does not read), metadata ("M") events whole,
every other phase (counters, instants, flows) dropped. Either format of the Chrome trace is read:
an object holding `traceEvents`, or a bare array of events, as text or gzipped (`.json.gz`, as GPU
runs send traces back and Perfetto opens them), decompressed as it is read and held to the same
bound. A malformed text is one JsonProblem.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from flowmoe.core.bounded_read import TRACE, open_regular
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.jsonfile import JsonProblem
from flowmoe.traces.summary import KERNEL_CAT

BLOCK = 1 << 20
MAX_VALUE = 64 << 20  # the longest single event (or other top-level value) a trace may hold
EVENT_KEYS = ("name", "ph", "pid", "tid", "ts", "dur", "cat")
# what a summary reads of a span's args (lane and node: of a kernel track's slice)
SPAN_ARGS = ("id", "op", "queued_us", "deps", "layer", "expert", "bytes", "lane", "node", "launch_us")
_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"
_GZIP = b"\x1f\x8b"  # the magic number every gzip member starts with


def read_trace(path: Path) -> dict[str, Any]:
    """The trace at `path` as {"traceEvents": [kept events], other top-level keys}."""
    with open_regular(path, FlowmoeError) as handle:
        if os.fstat(handle.fileno()).st_size > TRACE.limit:  # the documented bound of a trace file
            raise FlowmoeError(f"{path}: larger than {TRACE} (the most {TRACE.kind} may hold); not read")
        packed = handle.read(2) == _GZIP
        handle.seek(0)  # a regular file (open_regular): seekable
        stream: BinaryIO = gzip.GzipFile(fileobj=handle) if packed else handle  # type: ignore[assignment]
        try:
            return _Reader(stream).trace()
        except UnicodeDecodeError as exc:
            raise FlowmoeError(f"{path}: not UTF-8 text ({exc.reason})") from exc
        except JsonProblem as exc:
            raise FlowmoeError(f"{path}: {exc}") from exc
        except (gzip.BadGzipFile, EOFError) as exc:  # a damaged or cut gzip stream
            raise FlowmoeError(f"{path}: not a readable gzip file ({exc})") from exc


def kept(event: Any) -> dict[str, Any] | None:
    """What a summary needs of one event, or None for an event it does not read."""
    if not isinstance(event, dict):
        return None
    phase = event.get("ph")
    if phase == "M":
        return event
    if phase != "X":
        return None
    slim = {key: event[key] for key in EVENT_KEYS if key in event}
    if slim.get("cat") == KERNEL_CAT:
        slim.pop("name", None)
    args = event.get("args")
    if isinstance(args, dict):
        slim["args"] = {key: args[key] for key in SPAN_ARGS if key in args}
    return slim


class _Reader:
    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.eof = "", 0, False
        self.read = 0  # bytes of text read so far

    def trace(self) -> dict[str, Any]:
        first = self._peek()
        if first == "[":
            data: dict[str, Any] = {"traceEvents": [e for e in map(kept, self._array()) if e is not None]}
        elif first == "{":
            data = self._object()
        else:
            raise JsonProblem("no traceEvents list; not a Chrome trace (neither an object nor an array)")
        if self._peek() != "":
            raise JsonProblem("not valid JSON (text after the trace)")
        return data

    def _object(self) -> dict[str, Any]:
        self.pos += 1
        data: dict[str, Any] = {}
        if self._peek() == "}":
            self.pos += 1
            return data
        while True:
            key = self._value()
            if not isinstance(key, str) or self._peek() != ":":
                raise JsonProblem("not valid JSON (expecting a key and ':' in the trace object)")
            self.pos += 1
            if key == "traceEvents" and self._peek() == "[":
                data[key] = [e for e in map(kept, self._array()) if e is not None]
            else:
                data[key] = self._value()
            if not self._separator("}"):
                return data

    def _array(self) -> Iterator[Any]:
        self.pos += 1
        if self._peek() == "]":
            self.pos += 1
            return
        while True:
            yield self._value()
            if not self._separator("]"):
                return

    def _separator(self, close: str) -> bool:
        """True after a ',' (more follows), False after `close`."""
        found = self._peek()
        if found not in (",", close):
            raise JsonProblem(f"not valid JSON (expecting ',' or '{close}', found {found[:1]!r})")
        self.pos += 1
        return found == ","

    def _peek(self) -> str:
        """The next character that is not white space ("" at the end), loading blocks as needed."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.text) or not self._more(BLOCK):
                return self.text[self.pos : self.pos + 1]

    def _value(self) -> Any:
        """The next JSON value; a value cut by the end of the window loads more (doubling the read)."""
        self._peek()
        want = BLOCK
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                if self.eof:
                    raise JsonProblem(f"not valid JSON ({exc.msg})") from exc
                if len(self.text) - self.pos > MAX_VALUE:
                    raise JsonProblem(
                        f"an event longer than {MAX_VALUE >> 20} MiB, or not valid JSON"
                    ) from exc
                self._more(want)
                want *= 2
                continue
            except RecursionError as exc:
                raise JsonProblem("JSON nested too deeply") from exc
            except ValueError as exc:  # an integer of more digits than Python converts
                raise JsonProblem("not valid JSON: an integer of too many digits") from exc
            if end == len(self.text) and not self.eof and self._more(want):  # a number may go on
                continue
            self.pos = end
            return value

    def _more(self, size: int) -> bool:
        """Append up to `size` more bytes of text, dropping what was consumed; False at the end."""
        if self.eof:
            return False
        raw = self.handle.read(size)
        self.eof = not raw
        self.read += len(raw)
        if self.read > TRACE.limit:  # a gzipped trace unpacking past the bound of a trace's text
            raise JsonProblem(f"more than {TRACE} of text; not read")
        self.text = self.text[self.pos :] + self.decoder.decode(raw, final=self.eof)
        self.pos = 0
        return not self.eof
