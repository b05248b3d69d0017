"""A hierarchical roofline figure of a model on a hardware spec, in the style of MoE-Lightning's.

Roofs: CPU memory, GPU memory and the CPU->GPU link (each capped by its device's peak), the CPU and
GPU peaks, and the turning point P1. Ops: the MoE FFN of one decode layer for several batch sizes N
against the link (weights streamed once per layer for N tokens), with P2 for the FFN kernel at the
policy's micro-batch size; attention against the memory it runs from. Sized for a column of a
two-column paper: every mark named in the legend below the axes, the batch sizes written along the
foot of their lines (clear of the roofs and points), the axes fitted to the marks. The file type
follows the extension (.png, .svg, .pdf).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from attrs import evolve, frozen

from flowmoe.core.figure import COLUMN, check_suffix, pyplot, save
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.hrm import Hierarchy, Phase, layer_ops
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard

BATCHES = (32, 128, 1024, 16384)
TITLE = 50  # characters a line of the title holds at the column's width
MARGIN = 3.0  # the axes reach this factor past the outermost mark on each side (log scale)


@frozen
class Marks:
    """The points the figure places, in flop/byte and flop/s."""

    p1: float
    p2: float
    p2_perf: float
    ffn: tuple[tuple[int, float, float], ...]  # (N, link intensity, attainable) per batch size
    attention: tuple[str, float, float]  # (where it runs, intensity, attainable)


def plot_roofline(
    spec: ModelSpec,
    hw: HardwareSpec,
    policy: Policy,
    context: int,
    path: str | Path,
    guard: Guard = DEFAULT_GUARD,
) -> Any:
    """Draw and write the figure; returns the matplotlib Figure."""
    path = Path(path)
    check_suffix(path, "--plot")
    levels = Hierarchy.from_hardware(hw)
    marks = _marks(spec, levels, policy, context)
    with pyplot() as plt:
        fig, ax = plt.subplots(figsize=(COLUMN, 2.5))
        ax.set_xscale("log")
        ax.set_yscale("log")
        _fit(ax, levels, marks)
        _roofs(ax, levels)
        _points(ax, levels, marks, policy.micro_batch_size, context)
        ax.set_xlabel("operational intensity (flop/byte)")
        ax.set_ylabel("attainable GFLOP/s")
        title = f"{spec.name} on {hw.name}: decode, μ={policy.micro_batch_size}"
        ax.set_title("\n".join(textwrap.wrap(title, TITLE)))
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, handlelength=2.0,
                  columnspacing=1.0)  # fmt: skip
        save(fig, path, guard)
    return fig


def _marks(spec: ModelSpec, levels: Hierarchy, policy: Policy, context: int) -> Marks:
    mu = policy.micro_batch_size
    streamed = evolve(policy, weights_gpu_share=0.0, ffn_on="gpu")
    kernel = next(o for o in layer_ops(spec, Phase(mu, mu, 1, context), streamed) if o.name == "moe ffn")
    p2_perf = levels.gpu.attainable(kernel.intensity)
    ffn = []
    for n in BATCHES:
        op = next(
            o for o in layer_ops(spec, Phase(n, min(mu, n), 1, context), streamed) if o.name == "moe ffn"
        )
        ffn.append((n, op.link_intensity, min(levels.link * op.link_intensity, p2_perf)))
    attn = next(o for o in layer_ops(spec, Phase(mu, mu, 1, context), policy) if o.name == "attention")
    roof = levels.cpu if attn.place == "cpu" else levels.gpu
    attention = (attn.place, attn.intensity, roof.attainable(attn.intensity))
    return Marks(levels.p1, levels.p2(p2_perf), p2_perf, tuple(ffn), attention)


def _fit(ax: Any, levels: Hierarchy, marks: Marks) -> None:
    """Axes spanning the marks and the roofs' bends, MARGIN past them: no empty band."""
    gpu, cpu = levels.gpu, levels.cpu
    xs = [marks.p1, marks.p2, gpu.ridge, cpu.ridge, gpu.peak / levels.link, marks.attention[1]]
    xs += [x for _, x, _ in marks.ffn]
    ys = [cpu.peak, gpu.peak, marks.p2_perf, marks.attention[2]] + [y for _, _, y in marks.ffn]
    xs, ys = [x for x in xs if math.isfinite(x) and x > 0], [y for y in ys if y > 0]
    ax.set_xlim(min(xs) / MARGIN, max(xs) * MARGIN)
    ax.set_ylim(min(ys) / 1e9 / MARGIN**2, max(ys) / 1e9 * 2)  # room under the lowest for N's labels


def _roofs(ax: Any, levels: Hierarchy) -> None:
    import numpy as np

    low, high = ax.get_xlim()
    oi = np.logspace(math.log10(low), math.log10(high), 200)
    gpu, cpu = levels.gpu, levels.cpu
    ax.plot(oi, np.minimum(cpu.bandwidth * oi, cpu.peak) / 1e9, color="tab:blue", label="CPU memory")
    ax.plot(oi, np.minimum(gpu.bandwidth * oi, gpu.peak) / 1e9, color="tab:green", label="GPU memory")
    ax.plot(oi, np.minimum(levels.link * oi, gpu.peak) / 1e9, color="tab:red", label="CPU→GPU link")
    ax.axhline(cpu.peak / 1e9, color="tab:blue", linestyle="--", label="CPU peak")
    ax.axhline(gpu.peak / 1e9, color="tab:green", linestyle="--", label="GPU peak")


def _points(ax: Any, levels: Hierarchy, marks: Marks, mu: int, context: int) -> None:
    floor = ax.get_ylim()[0]
    for i, (n, x, perf) in enumerate(marks.ffn):
        label = "MoE FFN, batch N (streamed)" if i == 0 else None
        ax.plot([x, x], [floor, perf / 1e9], color="purple", linestyle=":", marker="o", markevery=[1],
                label=label)  # fmt: skip
        ax.annotate(f"N={n}", (x, floor), textcoords="offset points", xytext=(-1.5, 2), rotation=90,
                    ha="right", va="bottom", fontsize=6.5, color="purple")  # fmt: skip
    place, x, perf = marks.attention
    ax.plot([x], [perf / 1e9], linestyle="none", color="tab:purple", marker="s",
            label=f"attention ({place.upper()}, ctx {context})")  # fmt: skip
    ax.plot([marks.p1], [levels.cpu.peak / 1e9], linestyle="none", color="black", marker="o",
            label=f"P1 = {marks.p1:.0f}: CPU peak / link")  # fmt: skip
    ax.plot([marks.p2], [marks.p2_perf / 1e9], linestyle="none", color="tab:orange", marker=">", markersize=6,
            markerfacecolor="none", markeredgewidth=1.2, zorder=4,
            label=f"P2 = {marks.p2:.0f}: FFN at μ={mu} / link")  # fmt: skip
