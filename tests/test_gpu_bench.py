"""bench/gpu.py's dry run (--device cpu --tiny): every scheduler but eager gets an ok row whose
tokens match the CPU eager path, one made to fail mid-run (--fail-scheduler) is a row with its error
while the others go on, and each row is in the output file (JSON Lines) as soon as it finishes,
seen from outside while the run is still going."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.schedule_fixtures import gpu_schedulers

ROOT = Path(__file__).resolve().parent.parent
FAILING = "klotski"


def read(path: Path) -> list[dict[str, Any]]:
    """The complete lines written so far (a line being written is left for the next look)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def test_dry_run_isolates_a_failure_and_writes_rows_as_they_finish(tmp_path: Path) -> None:
    out = tmp_path / "gpu.jsonl"
    command = [sys.executable, "bench/gpu.py", "--device", "cpu", "--tiny", "--budgets", "t4",
               "--fail-scheduler", FAILING, "--out", str(out),
               "--trace-dir", str(tmp_path / "traces")]  # fmt: skip
    log = tmp_path / "stdout.txt"
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    seen: set[int] = set()  # the numbers of rows on file, looked at while the run went on
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        seen.add(sum(r["kind"] == "row" for r in read(out)))
        time.sleep(0.05)
    process.wait(timeout=60)
    output = log.read_text()
    assert process.returncode == 0, output
    rows = [r for r in read(out) if r["kind"] == "row"]
    # the twelve and accelerate: eager cannot run under the budgets, zero-inference's run is accelerate's
    schedulers = sorted(name for name in gpu_schedulers() if name not in ("eager", "zero-inference"))
    assert len(schedulers) == 13
    assert sorted(r["scheduler"] for r in rows if r["scheduler"] != "accelerate-offload") == schedulers
    assert any(0 < n < len(rows) for n in seen), f"rows appeared only at the end: {sorted(seen)}"
    for row in rows:
        if row["scheduler"] == "accelerate-offload":
            assert row["status"] == "ok" or row["status"].startswith("skipped"), row
        elif row["scheduler"] == FAILING:
            assert row["status"] == "error" and "InjectedFailure" in row["error"], row
        else:
            assert row["status"] == "ok", row
            assert row["tokens_match_cpu"] is True, row
            assert row["tokens_per_s"] > 0 and row["predicted_tokens_per_s"] > 0, row
            assert row["measured_over_predicted"] > 0 and row["nodes_per_decode_step"] > 0, row
            threads = row["thread_cpu"]  # each thread group's CPU per decode step (every lane inline here)
            assert threads["steps"] > 0 and threads["thread_cpu_s_per_step"]["main"] > 0, row
            live = sum(threads["thread_cpu_s_per_step"].values())  # schedstat lags a running thread's time
            assert live <= threads["process_cpu_s_per_step"] * 1.1 + 0.01, row
    tokens = {r["scheduler"]: r for r in read(out) if r["kind"] == "tokens"}
    assert sorted(tokens) == schedulers and all(r["match"] is True for r in tokens.values())
    assert "InjectedFailure" in output and "on-demand" in output  # the table, printed at the end
    assert "CPU s per decode step by thread" in output  # and the per-thread one


def test_rows_from_a_gpu_run_become_the_results_section(tmp_path: Path) -> None:
    """--results-from: the rows a GPU machine sent back (the H200 run kept in bench/gpu-runs) are
    written as RESULTS.md's section, the file's other sections kept, without running anything."""
    rows = ROOT / "bench/gpu-runs/2026-11-27-h200-isolated/gpu.jsonl"
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Another section\n\nkept\n")
    command = [sys.executable, "bench/gpu.py", "--results-from", str(rows), "--results", str(results)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    text = results.read_text()
    assert "## Another section\n\nkept" in text
    section = text.split("## CUDA path: the last GPU run (bench/gpu.py)")[1]
    assert "NVIDIA H200" in section
    measured = {line.split(" | ")[1] for line in section.splitlines() if line.startswith("| t4 |")}
    # the run predates the accelerate and zero-inference schedulers; Accelerate itself ran as the baseline row
    others = {"eager", "accelerate", "zero-inference"}
    assert measured == set(gpu_schedulers()) - others | {"accelerate-offload"}


def test_dry_run_with_int4_experts_runs_them_packed(tmp_path: Path) -> None:
    """--expert-format int4: the experts quantized as the model is set up, every row ok with the
    tokens of the eager scheduler on the same packed model, priced by the simulator in int4."""
    out = tmp_path / "gpu.jsonl"
    command = [sys.executable, "bench/gpu.py", "--device", "cpu", "--tiny", "--budgets", "t4",
               "--expert-format", "int4", "--schedulers", "cgopipe", "on-demand", "--no-accelerate",
               "--out", str(out), "--trace-dir", str(tmp_path / "traces")]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = read(out)
    meta = next(r for r in records if r["kind"] == "meta")
    assert meta["expert_format"] == "int4" and "experts int4" in meta["model"], meta
    rows = [r for r in records if r["kind"] == "row"]
    assert sorted(r["scheduler"] for r in rows) == ["cgopipe", "on-demand"]
    for row in rows:
        assert row["status"] == "ok" and row["tokens_match_cpu"] is True, row
        assert row["tokens_per_s"] > 0 and row["predicted_tokens_per_s"] > 0, row
