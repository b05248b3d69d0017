"""A hierarchical roofline figure of a model on a hardware spec, in the style of MoE-Lightning's.

Roofs: CPU memory, GPU memory and the CPU->GPU link (each capped by its
device's peak), the CPU and GPU peaks, and the turning point P1. Ops: the MoE
FFN of one decode layer for several batch sizes N against the link (weights
streamed once per layer for N tokens), with P2 for the FFN kernel at the
policy's micro-batch size; attention against the memory it runs from. The file
type follows the extension (.png, .svg, .pdf).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import evolve

from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.hrm import Hierarchy, Phase, layer_ops
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard, OutputKind

BATCHES = (32, 128, 1024, 16384)
PLOT_WRITER = "flowmoe plot"  # the figure's Software (PNG) or Creator (SVG, PDF): the mark of flowmoe's
PLOT = OutputKind("plot", PLOT_WRITER.encode(), at_start=False)


def plot_roofline(
    spec: ModelSpec,
    hw: HardwareSpec,
    policy: Policy,
    context: int,
    path: str | Path,
    guard: Guard = DEFAULT_GUARD,
) -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"{path}: roofline plots are written as .png, .svg or .pdf")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("roofline plots need matplotlib: pip install 'flowmoe[plot]'") from exc
    levels = Hierarchy.from_hardware(hw)
    fig, ax = plt.subplots(figsize=(9, 6.5))
    _roofs(ax, levels)
    _ops(ax, spec, levels, policy, context)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity (flop / byte)")
    ax.set_ylabel("attainable performance (GFLOP/s)")
    ax.set_title(f"{spec.name} on {hw.name}: hierarchical roofline (decode, μ={policy.micro_batch_size})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, path, guard)
    plt.close(fig)
    return path


def _roofs(ax: Any, levels: Hierarchy) -> None:
    import numpy as np

    oi = np.logspace(-2, 5, 400)
    gpu, cpu = levels.gpu, levels.cpu
    ax.plot(oi, np.minimum(cpu.bandwidth * oi, cpu.peak) / 1e9, color="tab:blue", label="CPU memory roof")
    ax.plot(oi, np.minimum(gpu.bandwidth * oi, gpu.peak) / 1e9, color="tab:green", label="GPU memory roof")
    ax.plot(oi, np.minimum(levels.link * oi, gpu.peak) / 1e9, color="tab:red", label="CPU->GPU link roof")
    ax.axhline(cpu.peak / 1e9, color="tab:blue", linestyle="--", label="CPU peak")
    ax.axhline(gpu.peak / 1e9, color="tab:green", linestyle="--", label="GPU peak")
    ax.scatter([levels.p1], [cpu.peak / 1e9], color="black", zorder=5)
    ax.annotate(
        f"P1 = {levels.p1:.0f}", (levels.p1, cpu.peak / 1e9), textcoords="offset points", xytext=(5, 8)
    )


def _ops(ax: Any, spec: ModelSpec, levels: Hierarchy, policy: Policy, context: int) -> None:
    mu = policy.micro_batch_size
    streamed = evolve(policy, weights_gpu_share=0.0, ffn_on="gpu")
    kernel = next(o for o in layer_ops(spec, Phase(mu, mu, 1, context), streamed) if o.name == "moe ffn")
    p2_perf = levels.gpu.attainable(kernel.intensity)
    p2 = levels.p2(p2_perf)
    ax.scatter([p2], [p2_perf / 1e9], color="tab:orange", marker=">", zorder=5)
    ax.annotate(f"P2 (FFN kernel, μ={mu}) = {p2:.0f}", (p2, p2_perf / 1e9), textcoords="offset points",
                xytext=(5, -14))  # fmt: skip
    for n in BATCHES:
        ffn = next(
            o for o in layer_ops(spec, Phase(n, min(mu, n), 1, context), streamed) if o.name == "moe ffn"
        )
        perf = min(levels.link * ffn.link_intensity, p2_perf)
        ax.vlines(ffn.link_intensity, 1, perf / 1e9, color="purple", linestyle=":", alpha=0.8)
        ax.annotate(
            f"N={n}", (ffn.link_intensity, perf / 1e9), textcoords="offset points", xytext=(2, 4), fontsize=8
        )
    ax.vlines([], 1, 1, color="purple", linestyle=":", label="MoE FFN, weights streamed, batch N")
    attn = next(o for o in layer_ops(spec, Phase(mu, mu, 1, context), policy) if o.name == "attention")
    roof = levels.cpu if attn.place == "cpu" else levels.gpu
    ax.scatter([attn.intensity], [roof.attainable(attn.intensity) / 1e9], color="tab:purple", marker="s",
               zorder=5, label=f"attention on {attn.place} (context {context})")  # fmt: skip


def _save(fig: Any, path: Path, guard: Guard = DEFAULT_GUARD) -> None:
    """Write through the write guard, the figure's metadata carrying PLOT's marker."""
    key = "Software" if path.suffix.lower() == ".png" else "Creator"  # the field each format has
    guard.write(
        path, PLOT, lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight", metadata={key: PLOT_WRITER})
    )
