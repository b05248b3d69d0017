"""bench/vs_llamacpp.py's rows: medians over the repeats and the paired ratio, repeat by repeat."""

from __future__ import annotations

import math

import pytest

from bench.vs_llamacpp import cell_result, rows_from

STEPS = 4  # decode steps a cell times


def repeat(ms: float) -> dict:
    """One worker's result: one cell (batch 1, 1 thread) whose decode steps each took `ms` (wall and CPU)."""
    steps = [(0.1, 0.1)] + [(ms / 1e3, ms / 1e3)] * STEPS  # the prefill, then the decode steps
    return {"cells": [cell_result(1, 1, (0.2, 0.2), steps, [[5, 6]], 0.5)], "peak_rss": 2**30}


def ratios(flowmoe: list[float], llama: list[float]) -> dict:
    runs = {("bfloat16", "flowmoe"): [repeat(ms) for ms in flowmoe],
            ("bfloat16", "llama.cpp"): [repeat(ms) for ms in llama]}  # fmt: skip
    return next(r for r in rows_from(runs, prompt=8) if r["tool"] == "llama.cpp")


def test_paired_ratio_takes_each_repeat_against_its_neighbour() -> None:
    """A slow episode over the second repeat slows both tools there: the medians' ratio moves, each
    pair's ratio does not."""
    row = ratios(flowmoe=[10.0, 30.0, 10.0, 20.0], llama=[11.0, 33.0, 11.0, 22.0])
    assert row["decode_paired_cpu_ratio"] == pytest.approx(1.1)
    assert row["decode_paired_wall_ratio"] == pytest.approx(1.1)
    assert row["decode_wall_ratio"] == pytest.approx(16.5 / 15.0)  # medians 16.5 and 15
    assert row["decode_wall_ms_repeats"] == pytest.approx([11.0, 33.0, 11.0, 22.0])


def test_paired_ratio_is_the_median_of_the_pairs() -> None:
    row = ratios(flowmoe=[10.0, 10.0, 10.0], llama=[8.0, 12.0, 30.0])
    assert row["decode_paired_wall_ratio"] == pytest.approx(1.2)
    assert not math.isnan(row["decode_best_ratio"])
