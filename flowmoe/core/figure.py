"""What every figure flowmoe draws shares (`plan --plot`, `reproduce --plot`, `trace plot`):
matplotlib loaded on demand (the `plot` extra), one style sized for a column of a two-column paper,
and the write through the write guard with flowmoe's mark in the file's metadata."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard, OutputKind

SUFFIXES = (".png", ".svg", ".pdf")
PLOT_WRITER = "flowmoe plot"  # the figure's Software (PNG) or Creator (SVG, PDF): the mark of flowmoe's
PLOT = OutputKind("plot", PLOT_WRITER.encode(), at_start=False)
COLUMN = 3.4  # inches: one column of a two-column paper (IEEE 3.5 in, ACM 3.33 in)
# 8 pt text, 7 pt ticks and legends: the sizes of a paper's captions and body at 100% (keys Any:
# matplotlib's stubs key rcParams by a Literal of every name)
STYLE: dict[Any, Any] = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "legend.frameon": False,
    "lines.linewidth": 1.0,
    "lines.markersize": 4,
    "axes.linewidth": 0.6,
    "grid.linewidth": 0.4,
    "pdf.fonttype": 42,  # TrueType in PDF: some venues refuse the Type 3 fonts written otherwise
    "svg.fonttype": "none",  # SVG text stays text
}


def check_suffix(path: Path, flag: str) -> None:
    """A figure's file type follows its extension: one of SUFFIXES, else one error line."""
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"{flag} {path}: use a .png, .svg or .pdf file name")


@contextlib.contextmanager
def pyplot() -> Iterator[Any]:
    """matplotlib.pyplot on the Agg backend, under STYLE; one error line where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("figures need matplotlib: pip install 'flowmoe[plot]'") from exc
    with plt.rc_context(STYLE):
        yield plt


def save(fig: Any, path: Path, guard: Guard = DEFAULT_GUARD) -> None:
    """Write through the write guard, the figure's metadata carrying PLOT's marker, then release
    the figure from pyplot (the Figure object stays readable)."""
    key = "Software" if path.suffix.lower() == ".png" else "Creator"  # the field each format has
    try:
        guard.write(
            path,
            PLOT,
            lambda tmp: fig.savefig(
                tmp,
                format=path.suffix.lower()[1:],
                dpi=300,
                bbox_inches="tight",
                pad_inches=0.02,
                metadata={key: PLOT_WRITER},
            ),
        )
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
