"""Hardware presets and profiles: sources, saving and loading, bad files, measured overheads in the
cost model, and `flowmoe calibrate` writing a profile every command can take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from attrs import evolve

from flowmoe.cli import main
from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import PRESETS, hardware, load_profile, save_profile, to_json
from flowmoe.core.plan import Lane, Op, TaskNode

PAPER_GPUS = {"t4", "l4", "a100-40", "a100-80", "h100", "h200", "rtx3090", "rtx4090"}


def test_presets_are_sourced_and_sane() -> None:
    assert set(PRESETS) >= PAPER_GPUS
    for name, spec in PRESETS.items():
        assert spec.name == name and spec.source, name
        assert spec.gpu_flops > spec.cpu_flops > 0 and spec.gpu_bandwidth > spec.h2d_bandwidth > 0, name
        assert spec.cpu_memory > spec.gpu_memory or name.startswith("4x"), name
    four = PRESETS["4xt4"]
    assert (
        four.gpu_flops == 4 * PRESETS["t4"].gpu_flops
        and four.h2d_bandwidth == 4 * PRESETS["t4"].h2d_bandwidth
    )


def test_profile_round_trip(tmp_path: Path) -> None:
    spec = evolve(
        PRESETS["l4"], name="mine", op_overhead=(("gpu.compute/expert_ffn", 1e-5),), cpu_attention_flops=1e9
    )
    path = save_profile(spec, tmp_path / "sub" / "hw.json")
    assert hardware(str(path)) == spec == load_profile(path)
    assert not list(path.parent.glob(".hw.json.*"))  # no temporary file left behind


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "not a flowmoe hardware profile"),
        ({"bogus": 1}, "unknown field 'bogus'"),
        ({"gpu_flops": -1}, "'gpu_flops' must be a non-negative number"),
        ({"gpu_flops": "fast"}, "'gpu_flops' must be a non-negative number"),
        ({"op_overhead": {"gpu.compute/gate": "x"}}, "'op_overhead' must map"),
        ({"name": 3}, "'name' must be a string"),
    ],
)
def test_bad_profiles(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**to_json(PRESETS["t4"]), **change}))
    with pytest.raises(ConfigError, match=message):
        hardware(str(path))


def test_missing_field_and_bad_json(tmp_path: Path) -> None:
    data = to_json(PRESETS["t4"])
    del data["cpu_memory"]
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="missing field 'cpu_memory'"):
        hardware(str(tmp_path / "a.json"))
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        hardware(str(tmp_path / "b.json"))
    with pytest.raises(ConfigError, match="unknown hardware 'v100'"):
        hardware("v100")


def test_cost_uses_measured_overheads_and_attention_throughput() -> None:
    base = PRESETS["t4"]
    spec = evolve(base, op_overhead=(("cpu.compute/cpu_attn", 0.5),), cpu_attention_flops=base.cpu_flops / 10)
    attn = TaskNode(0, Op.CPU_ATTN, Lane.CPU_COMPUTE, bytes=1, flops=int(1e12))
    ffn = TaskNode(1, Op.EXPERT_FFN, Lane.CPU_COMPUTE, bytes=1, flops=int(1e12))
    assert RooflineCost(spec)(attn) == pytest.approx(0.5 + 1e12 / (base.cpu_flops / 10))
    assert RooflineCost(spec)(ffn) == pytest.approx(base.cpu_launch + 1e12 / base.cpu_flops)
    copy = TaskNode(2, Op.PAGE_COPY, Lane.GPU_H2D, bytes=12 * 10**9)
    assert RooflineCost(spec)(copy) == pytest.approx(base.copy_latency + 1.0)


def test_calibrate_writes_a_profile_commands_take(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "machine.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--output", str(path)]) == 0
    spec = hardware(str(path))
    assert spec.cpu_flops > 0 and spec.cpu_bandwidth > 0 and spec.cpu_attention_flops
    assert spec.gpu_flops == spec.cpu_flops  # no CUDA asked for: the gpu.* lanes run on the CPU
    overheads = dict(spec.op_overhead)
    assert {"gpu.compute/expert_ffn", "cpu.compute/expert_ffn", "cpu.compute/cpu_attn"} <= set(overheads)
    assert all(v >= 0 for v in overheads.values())
    assert "calibration of" in capsys.readouterr().out
    model = ["--model", "olmoe-1b-7b", "--layers", "1", "--workload", "fixed:8:2", "--hardware", str(path)]
    argv = [
        "simulate",
        *model,
        "--scheduler",
        "eager",
        "--batch-size",
        "2",
        "--gpu-memory",
        "64GiB",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["throughput_tokens_per_second"] > 0
