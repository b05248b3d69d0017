"""`flowmoe reproduce --plot`: paper vs simulated bars, one panel per setting (log scale)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard
from flowmoe.study.roofline_plot import _save

COLUMNS = 4


def plot_reproduction(results: Sequence[dict[str, Any]], path: Path, guard: Guard = DEFAULT_GUARD) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("reproduce plots need matplotlib: pip install 'flowmoe[plot]'") from exc
    shown = [r for r in results if any(row["published"] is not None for row in r["rows"])]
    rows = max(1, math.ceil(len(shown) / COLUMNS))
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(4.2 * COLUMNS, 3.4 * rows), squeeze=False)
    for ax, result in zip(axes.flat, shown, strict=False):
        systems = [row for row in result["rows"] if row["published"] is not None]
        x = range(len(systems))
        ax.bar([i - 0.2 for i in x], [row["published"] for row in systems], 0.4, label="paper")
        ax.bar([i + 0.2 for i in x], [row["simulated"] or 0.0 for row in systems], 0.4, label="simulated")
        ax.set_xticks(list(x), [row["system"] for row in systems], rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(systems[0]["metric"], fontsize=8)
        ax.set_title(f"{result['paper']}: {result['setting']}", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.tight_layout()
    _save(fig, path, guard)
    plt.close(fig)
    return path
