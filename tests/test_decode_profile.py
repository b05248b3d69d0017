"""bench/decode_profile.py on a tiny checkpoint: every node of a decode step is timed, the per-node
times add up to the step, and the weight bytes the kernels read are the step's own (each layer's
routed experts, the LM head, the attention projections)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowmoe.kernels import cpu_expert
from flowmoe.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def test_decode_profile_accounts_for_the_step(mixtral_folder: Path, tmp_path: Path) -> None:
    if cpu_expert.library() is None:
        pytest.skip("no C compiler: the kernels it times are not built")
    out = tmp_path / "profile.json"
    command = [sys.executable, "bench/decode_profile.py", "--model", str(mixtral_folder),
               "--dtypes", "float32", "--threads", "1", "--rounds", "1", "--steps", "3", "--prompt", "6",
               "--roof-mib", "8", "--scheduler", "eager", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (cell,) = json.loads(out.read_text())["cells"]
    ops = {o["op"]: o for o in cell["ops"]}
    assert {"EMBED", "PRE_ATTN", "GATE", "EXPERT_FFN", "COMBINE", "LM_HEAD", "outside nodes"} <= ops.keys()
    assert sum(o["ms"] for o in ops.values()) == pytest.approx(cell["profiled_step_ms"], rel=1e-6)
    spec = load_model(mixtral_folder, "float32").spec
    hidden, moe = spec.hidden, spec.moe
    expert = 3 * hidden * moe.intermediate * 4  # gate, up and down, fp32
    assert ops["EXPERT_FFN"]["weight_mb"] == pytest.approx(spec.layers * moe.top_k * expert / 1e6)
    assert ops["LM_HEAD"]["weight_mb"] == pytest.approx(spec.vocab * hidden * 4 / 1e6)
    assert ops["GATE"]["weight_mb"] == pytest.approx(spec.layers * moe.experts * hidden * 4 / 1e6)
    assert all(o["kernel_ms"] <= o["ms"] for o in ops.values())
    wrappers = {k["kernel"]: k for k in cell["kernels"]}  # the same kernels' time, by wrapper
    assert {"cpu_expert.swiglu_routed", "cpu_attention_ends.pre_attention"} <= wrappers.keys()
    assert sum(k["ms"] for k in wrappers.values()) == pytest.approx(sum(o["kernel_ms"] for o in ops.values()))
    assert wrappers["cpu_expert.swiglu_routed"]["calls"] == spec.layers  # one call a layer's experts
