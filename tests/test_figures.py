"""Every figure flowmoe draws (issue 27, item 7): `plan --plot`, `reproduce --plot` and `trace plot`,
each rendered to .png, .svg and .pdf and checked written and not trivial (size; a PNG not blank and
of several colours), its legend naming every mark, its labels clear of each other, its width that
of a column of a two-column paper; and the refusals (a bad extension, the write guard, matplotlib
missing) one line each, exit 2."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from PIL import Image

from flowmoe.cli import main
from flowmoe.core.executor import Span
from flowmoe.core.figure import STYLE
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.study.reproduce.plot import plot_reproduction
from flowmoe.study.roofline_plot import BATCHES, plot_roofline
from flowmoe.traces.chrome import chrome_trace
from flowmoe.traces.plot import KERNELS, panels, plot_trace
from flowmoe.traces.trace import KernelSlice, StepWindow, Trace
from flowmoe.traces.trace_file import read_trace

FORMATS = (".png", ".svg", ".pdf")
MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<?xml", ".pdf": b"%PDF"}
SMALL = ["--model", "olmoe-1b-7b", "--layers", "1", "--workload", "fixed:8:2", "--hardware", "t4"]


def _written(path: Path) -> None:
    """Written in its format, not trivial; a PNG at most a column wide (at its 300 dpi), not blank and
    of many colours."""
    data = path.read_bytes()
    assert data.startswith(MAGIC[path.suffix]), path
    assert len(data) > 8_000, (path, len(data))
    if path.suffix != ".png":
        return
    image = Image.open(path).convert("RGB")
    assert image.width <= 3.6 * 300, image.size  # a column: 3.33-3.5 in, bbox_inches="tight" may trim
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) >= 8
    white = sum(count for count, rgb in colours if rgb == (255, 255, 255))
    assert white < 0.95 * image.width * image.height  # something drawn


def _legend(fig: Any) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def _overlaps(fig: Any) -> list[tuple[str, str]]:
    """Pairs of text the figure shows (titles, axis and tick labels, annotations, legends) whose boxes
    overlap, measured as saved (under STYLE)."""
    with plt.rc_context(STYLE):
        canvas = FigureCanvasAgg(fig)  # the figure is closed (released from pyplot) once written
        canvas.draw()
        renderer = canvas.get_renderer()
        ticks = {
            id(t)
            for ax in fig.axes
            for axis in (ax.xaxis, ax.yaxis)
            for t in axis.get_ticklabels(which="both")
        }
        texts = [t for t in fig.findobj(Text) if id(t) not in ticks] + [
            t for ax in fig.axes for t in _shown_ticks(ax)
        ]
        boxes = [(t.get_text(), t.get_window_extent(renderer).shrunk(0.97, 0.9))
                 for t in texts if t.get_visible() and t.get_text().strip()]  # fmt: skip
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _shown_ticks(ax: Any) -> list[Any]:
    """The tick labels inside the axes' limits (those outside are kept but not drawn)."""
    (x_low, x_high), (y_low, y_high) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    xs = [t for t in ax.xaxis.get_ticklabels(which="both") if x_low <= t.get_position()[0] <= x_high]
    ys = [t for t in ax.yaxis.get_ticklabels(which="both") if y_low <= t.get_position()[1] <= y_high]
    return xs + ys


# ---- plan --plot


@pytest.mark.parametrize("suffix", FORMATS)
def test_roofline_in_each_format(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"roof{suffix}"
    plot_roofline(preset("mixtral-8x7b"), hardware("l4"), Policy(micro_batch_size=128), 141, path)
    _written(path)


@pytest.mark.parametrize(
    ("model", "gpu"), [("mixtral-8x7b", "t4"), ("olmoe-1b-7b", "t4"), ("deepseek-v3", "h100")]
)
def test_roofline_names_every_mark_fits_its_marks_and_no_label_overlaps(
    tmp_path: Path, model: str, gpu: str
) -> None:
    fig = plot_roofline(preset(model), hardware(gpu), Policy(micro_batch_size=128), 141, tmp_path / "r.png")
    (ax,) = fig.axes
    labels = _legend(fig)
    for name in ("CPU memory", "GPU memory", "CPU→GPU link", "CPU peak", "GPU peak", "MoE FFN, batch N"):
        assert any(label.startswith(name) for label in labels), (name, labels)
    assert sum(label.startswith(("P1 = ", "P2 = ", "attention")) for label in labels) == 3
    named = {(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.get_lines()
             if not line.get_label().startswith("_")}  # fmt: skip
    for line in ax.get_lines():  # every mark drawn looks like one the legend names
        assert (line.get_color(), line.get_marker(), line.get_linestyle()) in named, line
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"N={n}" for n in BATCHES)
    assert _overlaps(fig) == []
    (x_low, x_high), (y_low, y_high) = ax.get_xlim(), ax.get_ylim()
    marks = [line.get_xydata()[-1] for line in ax.get_lines() if line.get_marker() not in ("None", "")]
    assert all(x_low < x < x_high and y_low < y < y_high for x, y in marks)  # the N lines: marked at the top
    lowest, highest = min(y for _, y in marks), max(y for _, y in marks)

    def share(y: float) -> float:
        return (math.log(y) - math.log(y_low)) / (math.log(y_high) - math.log(y_low))

    assert share(lowest) < 0.3 and share(highest) > 0.7  # no empty band above or below the marks


def test_plan_plot(tmp_path: Path) -> None:
    path = tmp_path / "roof.pdf"
    assert (
        main(["plan", "-m", "mixtral-8x7b", "--hardware", "l4", "--max-batch", "1024", "--plot", str(path)])
        == 0
    )
    _written(path)


# ---- reproduce --plot


def _results() -> list[dict[str, Any]]:
    """Two papers' settings as `reproduce` gives them (run.py's keys): figures, hit rates, speedups,
    a figure not run and one the paper gives only as a ratio."""

    def row(system: str, published: float | None, simulated: float | None, metric: str = "tok/s") -> dict:
        ratio = simulated / published if published and simulated else None
        return {
            "system": system,
            "metric": metric,
            "published": published,
            "simulated": simulated,
            "ratio": ratio,
        }

    def speedup(ratio: float) -> dict:
        return {"faster": "a", "slower": "b", "published": 2.0, "simulated": 2.0 * ratio, "ratio": ratio}

    first = {"paper": "moe-lightning", "setting": "S1", "rows": [row("A", 100.0, 190.0), row("B", 30.0, 46.0),
             row("C", 9.5, 15.0), row("D", 7.8, None), row("E", None, 6.5)],
             "speedups": [speedup(1.2), speedup(0.96), speedup(1.8)]}  # fmt: skip
    second = {"paper": "fiddler", "setting": "hit rate", "rows": [row("popular", 0.25, 0.30, "hit rate"),
              row("random", 0.22, 0.25, "hit rate")], "speedups": [speedup(0.27)]}  # fmt: skip
    return [first, second]


@pytest.mark.parametrize("suffix", FORMATS)
def test_reproduction_in_each_format(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"paper{suffix}"
    plot_reproduction(_results(), path)
    _written(path)


def test_reproduction_is_a_ratio_dot_plot_naming_every_mark(tmp_path: Path) -> None:
    fig = plot_reproduction(_results(), tmp_path / "paper.png")
    absolute, speedups = fig.axes[:2]
    assert [t.get_text() for t in absolute.get_yticklabels()] == ["moe-lightning (3)", "fiddler (2)"]
    assert [t.get_text() for t in speedups.get_yticklabels()] == ["moe-lightning (3)", "fiddler (1)"]
    assert set(_legend(fig)) == {
        "tokens/s",
        "hit rate",
        "speedup",
        "median (≥3)",
        "equal (1.0)",
        "target band",
    }
    for ax, ratios in (
        (absolute, [1.9, 46 / 30, 15 / 9.5, 0.30 / 0.25, 0.25 / 0.22]),
        (speedups, [1.2, 0.96, 1.8, 0.27]),
    ):
        dots = sorted(
            x for line in ax.get_lines() if line.get_marker() in ("o", "D", "^") for x in line.get_xdata()
        )
        assert dots == pytest.approx(sorted(ratios))
        assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # the line at 1.0
    low, high = speedups.get_xlim()
    assert low < 0.27 and high > 2.0 and speedups.get_xscale() == "log"  # ratios: 1/2 and 2 as far from 1
    assert _overlaps(fig) == []


def test_reproduce_plot(tmp_path: Path) -> None:
    path = tmp_path / "paper.svg"
    assert main(["reproduce", "fiddler", "--quick", "--plot", str(path)]) == 0
    _written(path)


# ---- trace plot


def _span(i: int, lane: Lane, op: Op, start: float, end: float) -> Span:
    return Span(TaskNode(i, op, lane, layer=0, mb=0), start, end, start)


def _hand_made(path: Path, kernels: bool = True) -> Path:
    """Two steps of 10 ms: gpu.compute runs attention then an expert while gpu.h2d copies pages; the
    kernels of the GPU nodes under gpu.compute, one kernel launched by no node."""
    spans, slices = [], []
    for step in range(2):
        t = step * 0.010
        spans += [_span(3 * step, Lane.GPU_COMPUTE, Op.GPU_ATTN, t, t + 0.004),
                  _span(3 * step + 1, Lane.GPU_H2D, Op.PAGE_COPY, t, t + 0.006),
                  _span(3 * step + 2, Lane.GPU_COMPUTE, Op.EXPERT_FFN, t + 0.006, t + 0.009)]  # fmt: skip
        slices += [
            KernelSlice("attn", "kernel", t + 0.001, t + 0.003, Lane.GPU_COMPUTE, 7, 3 * step),
            KernelSlice("ffn", "kernel", t + 0.0065, t + 0.0085, Lane.GPU_COMPUTE, 7, 3 * step + 2),
        ]
    slices.append(KernelSlice("memset", "memset", 0.0001, 0.0002, None, 9))
    steps = [StepWindow(0.0, 0.010), StepWindow(0.010, 0.020)]
    trace = Trace(spans=spans, steps=steps, kernels=slices if kernels else [])
    path.write_text(json.dumps(chrome_trace([trace])))
    return path


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Traces of a tiny simulated run under two schedulers, the second gzipped."""
    folder = tmp_path_factory.mktemp("traces")
    eager, lru = folder / "eager.json", folder / "lru-cache.json"
    assert main(["simulate", *SMALL, "-s", "eager", "--trace", str(eager)]) == 0
    assert main(["simulate", *SMALL, "-s", "lru-cache", "--trace", str(lru)]) == 0
    packed = folder / "lru-cache.json.gz"
    with lru.open("rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return eager, packed


@pytest.mark.parametrize("suffix", FORMATS)
def test_trace_plot_of_a_run_in_each_format(
    tmp_path: Path, simulated: tuple[Path, Path], suffix: str
) -> None:
    path = tmp_path / f"lanes{suffix}"
    assert main(["trace", "plot", str(simulated[0]), "-o", str(path)]) == 0
    _written(path)


def test_two_traces_stacked_on_one_time_axis(tmp_path: Path, simulated: tuple[Path, Path]) -> None:
    path = tmp_path / "cmp.pdf"
    assert main(["trace", "plot", *map(str, simulated), "-o", str(path), "--steps", "1:3"]) == 0
    _written(path)
    shown = panels([(name, read_trace(p)) for name, p in zip(("eager", "lru-cache"), simulated, strict=True)],
                   steps=(1, 3))  # fmt: skip
    fig = plot_trace(shown, tmp_path / "cmp.png")
    _written(tmp_path / "cmp.png")
    top, bottom = fig.axes
    assert (top.get_title(loc="left"), bottom.get_title(loc="left")) == ("eager", "lru-cache")
    assert top.get_xlim() == bottom.get_xlim() and top.get_shared_x_axes().joined(top, bottom)
    assert [t.get_text() for t in top.get_yticklabels()] == [t.get_text() for t in bottom.get_yticklabels()]
    ops = {span_op for p in shown for span_op in p.ops}
    assert ops >= {"expert_ffn", "gpu_attn"} and set(_legend(fig)) == ops
    drawn = {tuple(c.get_facecolor()[0]) for ax in fig.axes for c in ax.collections}
    assert len(drawn) == len(ops)  # a colour per operation, each in the legend
    assert "step 1" in bottom.get_xlabel()
    assert _overlaps(fig) == []


def test_kernels_are_thin_rows_under_their_lane(tmp_path: Path) -> None:
    trace = _hand_made(tmp_path / "k.json")
    fig = plot_trace(panels([("k", read_trace(trace))]), tmp_path / "k.png")
    _written(tmp_path / "k.png")
    (ax,) = fig.axes
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["gpu.compute", "kernels", "gpu.h2d", "kernels, no node"]
    assert set(_legend(fig)) == {"gpu_attn", "expert_ffn", "page_copy", KERNELS}
    bars = {(c.get_paths()[0].get_extents().height, len(c.get_paths())) for c in ax.collections}
    heights = sorted({round(h, 4) for h, _ in bars})
    assert len(heights) == 2 and heights[0] < heights[1] / 2  # kernel bars thinner than nodes'
    assert _overlaps(fig) == []


def test_a_time_window_clips_every_bar(tmp_path: Path) -> None:
    trace = read_trace(_hand_made(tmp_path / "k.json"))
    (panel,) = panels([("k", trace)], window_ms=(5.0, 12.0))
    assert (panel.first, panel.last) == (5000.0, 12000.0)
    assert all(5000.0 <= start < end <= 12000.0 for bars in panel.bars.values() for start, end in bars)
    assert set(panel.bars) == {("gpu.compute", False, "gpu_attn"), ("gpu.compute", False, "expert_ffn"),
                               ("gpu.h2d", False, "page_copy"), ("gpu.compute", True, KERNELS)}  # fmt: skip
    (whole,) = panels([("k", trace)])
    (steps,) = panels([("k", trace)], steps=(1, None))
    assert (whole.first, whole.last) == (0.0, 19000.0) and (steps.first, steps.last) == (0.0, 10000.0)
    assert (
        main(["trace", "plot", str(tmp_path / "k.json"), "-o", str(tmp_path / "w.svg"), "--window", "5:12"])
        == 0
    )
    _written(tmp_path / "w.svg")


def test_a_comparison_trace_gives_a_panel_per_scheduler(tmp_path: Path) -> None:
    trace = tmp_path / "cmp.json"
    assert main(["compare", *SMALL, "--schedulers", "eager,lru-cache", "--trace", str(trace)]) == 0
    titles = [p.title for p in panels([("cmp", read_trace(trace))])]
    assert titles == ["eager", "lru-cache"]
    assert main(["trace", "plot", str(trace), "-o", str(tmp_path / "cmp.png")]) == 0
    _written(tmp_path / "cmp.png")


# ---- refusals: one line, exit 2


def _one_line(capsys: pytest.CaptureFixture[str], words: str, usage: bool = False) -> None:
    """One error line holding `words` (after argparse's usage, for a flag argparse refuses)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert (usage or len(err) == 1) and words in err[-1], err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["plan", "-m", "mixtral-8x7b", "--plot", "{tmp}/r.txt"],
            "--plot {tmp}/r.txt: use a .png, .svg or .pdf",
        ),
        (
            ["trace", "plot", "{trace}", "-o", "{tmp}/lanes.jpg"],
            "--output {tmp}/lanes.jpg: use a .png, .svg or .pdf",
        ),
        (
            ["trace", "plot", "{trace}", "-o", "{tmp}/f.png", "--steps", "5:9"],
            "steps 5:9 hold none of its 2 steps",
        ),
        (["trace", "plot", "{trace}", "-o", "{tmp}/f.png", "--window", "50:"], "--window starts at 50 ms"),
        (["trace", "plot", "{trace}", "-o", "{tmp}/f.png", "--steps", "2:1"], "B must be past A"),
        (
            ["trace", "plot", "{trace}", "-o", "{tmp}/f.png", "--steps", "1:2", "--window", "0:1"],
            "not allowed",
        ),
        (["trace", "plot", "{tmp}/none.json", "-o", "{tmp}/f.png"], "no such file"),
    ],
    ids=[
        "plan extension",
        "trace extension",
        "steps outside",
        "window after the end",
        "steps reversed",
        "steps and window",
        "no trace",
    ],
)
def test_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    trace = _hand_made(tmp_path / "k.json")
    fill = {"tmp": str(tmp_path), "trace": str(trace)}
    assert main([a.format(**fill) for a in argv]) == 2
    _one_line(capsys, words.format(**fill), usage=words in ("B must be past A", "not allowed"))
    assert not (tmp_path / "f.png").exists()


def test_steps_need_step_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_hand_made(tmp_path / "k.json").read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("name") != "flowmoe_steps"]
    (tmp_path / "other.json").write_text(json.dumps(data))
    assert (
        main(["trace", "plot", str(tmp_path / "other.json"), "-o", str(tmp_path / "f.png"), "--steps", "0:1"])
        == 2
    )
    _one_line(capsys, "no step windows")


def test_the_write_guard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file flowmoe did not write is left as it is without --force, replaced with it; a plot flowmoe
    wrote is replaced; the trace read is never written over, even as a .png and with --force."""
    trace = _hand_made(tmp_path / "k.json")
    for suffix in FORMATS:
        target = tmp_path / f"mine{suffix}"
        target.write_bytes(b"my figure\n")
        argv = ["trace", "plot", str(trace), "-o", str(target)]
        assert main(argv) == 2
        _one_line(capsys, "not a plot flowmoe wrote")
        assert target.read_bytes() == b"my figure\n"
        assert main([*argv, "--force"]) == 0
        assert main(argv) == 0  # flowmoe's own, by the mark in its metadata
        _written(target)
    same = tmp_path / "k.png"
    same.write_bytes(trace.read_bytes())
    assert main(["trace", "plot", str(same), "-o", str(same), "--force"]) == 2
    _one_line(capsys, "is a trace to plot")
    assert same.read_bytes() == trace.read_bytes()


def test_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _hand_made(tmp_path / "k.json")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["trace", "plot", str(trace), "-o", str(tmp_path / "f.png")]) == 2
    _one_line(capsys, "pip install 'flowmoe[plot]'")
    assert main(["plan", "-m", "mixtral-8x7b", "--max-batch", "64", "--plot", str(tmp_path / "r.png")]) == 2
    _one_line(capsys, "pip install 'flowmoe[plot]'")
    assert not (tmp_path / "f.png").exists() and not (tmp_path / "r.png").exists()
