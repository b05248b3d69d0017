"""Two builds of one C kernel family compared in one process (bench/packed_rows.py, expert_rows.py):
the working tree's and a git revision's, compiled alike, called alternately over distinct weights
("dram": each call another expert's weights, beyond the LLC) and over one ("warm"), every output
compared bit for bit, the thread's CPU time as the clock (a shared machine's preemption excluded),
and a 1-thread read roof (torch.sum over 1 GiB on huge pages) sampled each round, the best kept."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console
from rich.table import Table

from flowmoe.kernels import native
from flowmoe.kernels.host_memory import huge_empty

ROOT = Path(__file__).resolve().parent.parent
ROOF_BYTES = 1 << 30
MODES = ("dram", "warm")


def parser(doc: str | None, out: str) -> argparse.ArgumentParser:
    """The flags both benches take (--baseline, --rounds, --rows, --out: bench/`out` by default,
    --moved-bits)."""
    made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("--baseline", default="HEAD", help="git revision of the kernels to compare against")
    made.add_argument("--rounds", type=int, default=9)
    made.add_argument("--rows", default="1,2,8")
    made.add_argument("--out", type=Path, default=ROOT / "bench" / out)
    made.add_argument(
        "--moved-bits",
        action="store_true",
        help="a change that moves the outputs' bits by design: report the largest relative difference",
    )
    return made


@contextlib.contextmanager
def builds(baseline: str, sources: Sequence[str]) -> Iterator[dict[str, ctypes.CDLL]]:
    """{"old": the kernels at `baseline`, "new": the working tree's}, built in a folder kept while in use."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        yield {
            name: library(rev, Path(tmp) / name, sources) for name, rev in (("old", baseline), ("new", None))
        }


def library(rev: str | None, folder: Path, sources: Sequence[str]) -> ctypes.CDLL:
    """The kernels compiled from `sources` (C files under kernels/) and the headers they include, at
    git revision `rev` (None: the working tree's), alone and as native.py compiles them: both builds
    alike, no other kernel moves their code."""
    folder.mkdir()
    wanted, done = list(sources), set()
    while wanted:
        name = wanted.pop()
        if name in done:
            continue
        done.add(name)
        text = _source(rev, name)
        (folder / name).write_bytes(text)
        wanted += (n.decode() for n in re.findall(rb'^#include "([\w.]+)"', text, flags=re.MULTILINE))
    out = folder / "kernels.so"
    compiled = [str(folder / name) for name in sources]
    subprocess.run(["cc", *native.FLAGS, *compiled, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def _source(rev: str | None, name: str) -> bytes:
    """kernels/`name` at `rev` (None: the working tree's)."""
    if rev is None:
        return (ROOT / "kernels" / name).read_bytes()
    shown = subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, capture_output=True)
    shown.check_returncode()
    return shown.stdout


class Calls(Protocol):
    """One build's calls: `run(e, into)` calls it over weights `e` into output `into`."""

    outs: list[torch.Tensor]

    def run(self, e: int, into: int) -> None: ...


def clocked(fn: Callable[[], object]) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


class Roof:
    """The best 1-thread read rate (GB/s) seen so far."""

    def __init__(self) -> None:
        self.buffer = huge_empty(ROOF_BYTES).view(torch.float32).fill_(1.0)
        self.best = 0.0

    def sample(self) -> None:
        self.best = max(self.best, ROOF_BYTES / clocked(self.buffer.sum) / 1e9)


def compared(
    calls: dict[str, Calls], count: int, rounds: int, roof: Roof, moved_bits: bool = False
) -> tuple[dict[str, tuple[list, list]], float]:
    """Per mode: the old and the new build's ms per call over `rounds` rounds of `count` calls, the
    order flipped every round; and the largest relative difference between their outputs. Every
    output is compared bit for bit each round unless `moved_bits`."""
    times: dict[tuple[str, str], list[float]] = {(n, m): [] for n in calls for m in MODES}
    moved = 0.0
    for r in range(rounds):
        roof.sample()
        for mode in MODES:
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                c = calls[name]
                if mode == "warm":
                    c.run(0, 0)
                weights = range(count) if mode == "dram" else [0] * count
                times[name, mode].append(clocked(functools.partial(_pass, c, weights)) / count * 1e3)
        for old, new in zip(calls["old"].outs, calls["new"].outs, strict=True):
            assert moved_bits or torch.equal(old.view(torch.uint8), new.view(torch.uint8)), "the bits moved"
            moved = max(moved, ((new.float() - old.float()).norm() / old.float().norm()).item())
    return {m: (times["old", m], times["new", m]) for m in MODES}, moved


def _pass(calls: Calls, weights: Sequence[int]) -> None:
    """Call i over weights[i] into output i, for each i."""
    for into, e in enumerate(weights):
        calls.run(e, into)


def summary(
    keys: dict[str, Any], old: list[float], new: list[float], nbytes: int, moved: float
) -> dict[str, Any]:
    """A table row: `keys`, the medians of the ms, of the per-round speedups (with min and max), GB/s,
    the outputs' largest relative difference (`moved`)."""
    speedups = sorted(a / b for a, b in zip(old, new, strict=True))
    old_ms, new_ms = statistics.median(old), statistics.median(new)
    return keys | {
        "old_ms": old_ms,
        "new_ms": new_ms,
        "speedup": statistics.median(speedups),
        "speedup_min": speedups[0],
        "speedup_max": speedups[-1],
        "moved": moved,
        "bytes": nbytes,
        "old_gbs": nbytes / old_ms / 1e6,
        "new_gbs": nbytes / new_ms / 1e6,
    }


def report(title: str, keys: Sequence[str], rows: list[dict[str, Any]], roof: float, load: list[float],
           record: dict[str, Any], out: Path) -> None:  # fmt: skip
    """Prints the table (`keys` first, then times, GB/s, share of the roof, speedup, the outputs'
    largest relative difference) and writes `record` with the rows, the roof, the load and the CPU to
    `out`."""
    table = Table(title=title)
    for column in (*keys, "old ms", "new ms", "old GB/s", "new GB/s", "new % roof", "speedup", "rel. diff"):
        table.add_column(column)
    for res in rows:
        speedup = f"{res['speedup']:.2f}x [{res['speedup_min']:.2f}, {res['speedup_max']:.2f}]"
        table.add_row(
            *(str(res[k]) for k in keys),
            f"{res['old_ms']:.3f}",
            f"{res['new_ms']:.3f}",
            f"{res['old_gbs']:.1f}",
            f"{res['new_gbs']:.1f}",
            f"{100 * res['new_gbs'] / roof:.0f}",
            speedup,
            f"{res['moved']:.1e}",
        )
    Console(width=160).print(table)
    print(f"read roof {roof:.1f} GB/s (1 thread); load average {min(load):.2f}-{max(load):.2f}")
    record |= {
        "cpu": native.cpuinfo_field("model name"),
        "read_roof_gbs": roof,
        "load": [min(load), max(load)],
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
