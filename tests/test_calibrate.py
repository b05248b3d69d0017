"""Hardware profiles: saving and loading, bad files, measured overheads in the
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
from flowmoe.study import calibrate as calibration


def test_profile_round_trip(tmp_path: Path) -> None:
    spec = evolve(
        PRESETS["l4"],
        name="mine",
        op_overhead=(("gpu.compute/expert_ffn", 1e-5),),
        cpu_roofline=((0.5, 1e9), (8.0, 2e9)),
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


def test_presets_by_name_in_any_case() -> None:
    """issue 27 item 9: `--hardware T4` is the t4 preset."""
    assert hardware("T4") is PRESETS["t4"]
    assert hardware("A100-80") is PRESETS["a100-80"]
    assert hardware("MoE-Lightning-S1") is PRESETS["moe-lightning-s1"]
    with pytest.raises(ConfigError, match="unknown hardware 'V100'"):
        hardware("V100")


def test_cost_uses_measured_rooflines_and_overheads() -> None:
    base = PRESETS["t4"]
    curve = ((1.0, 1e9), (100.0, 1e11))  # 1 GFLOP/s at 1 flop/B, 100 GFLOP/s at 100 flop/B
    spec = evolve(base, op_overhead=(("cpu.compute/cpu_attn", 0.5),), cpu_roofline=curve,
                  cpu_attention_roofline=((1.0, 1e8),))  # fmt: skip
    cost = RooflineCost(spec)

    def seconds(op: Op, flops: float, n_bytes: float) -> float:
        return cost(TaskNode(0, op, Lane.CPU_COMPUTE, bytes=int(n_bytes), flops=int(flops)))

    launch = cost.fixed(Lane.CPU_COMPUTE, Op.EXPERT_FFN)  # the node's launch and its ops' dispatch
    assert seconds(Op.EXPERT_FFN, 1e10, 1e9) == pytest.approx(launch + 1.0)  # 10 flop/B: 10 GFLOP/s
    assert seconds(Op.EXPERT_FFN, 1e12, 1e9) == pytest.approx(launch + 10.0)  # flat above the last point
    assert seconds(Op.EXPERT_FFN, 5e8, 1e9) == pytest.approx(launch + 1.0)  # below: 1e9 B at 1 GB/s
    assert seconds(Op.CPU_ATTN, 1e8, 1e8) == pytest.approx(0.5 + 1.0)  # attention has a roofline of its own
    copy = TaskNode(2, Op.PAGE_COPY, Lane.GPU_H2D, bytes=int(base.h2d_bandwidth))
    assert cost(copy) == pytest.approx(base.copy_latency + 1.0)
    plain = RooflineCost(base)(TaskNode(1, Op.EXPERT_FFN, Lane.GPU_COMPUTE, bytes=1, flops=int(65e12)))
    assert plain == pytest.approx(base.gpu_launch + 1.0 / base.gemm_share(512))  # presets: sustained GEMMs


STREAM = 7.5e9  # the stream copy calibrate measures, fixed so the profile's DRAM share can be checked


def test_calibrate_writes_a_profile_commands_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile commands take; its host DRAM bandwidth (what the host lanes share) is the
    measured stream copy."""
    monkeypatch.setattr(calibration, "copy_bandwidth", lambda *_args: STREAM)
    path = tmp_path / "machine.json"
    assert main(["calibrate", "--quick", "--device", "cpu", "--output", str(path)]) == 0
    spec = hardware(str(path))
    assert spec.cpu_flops > 0 and spec.cpu_bandwidth > 0
    assert len(spec.cpu_roofline) == 10 and len(spec.cpu_attention_roofline) == 3
    assert spec.gpu_flops == spec.cpu_flops  # no CUDA asked for: the gpu.* lanes run on the CPU
    host = RooflineCost(spec).host_memory_bandwidth  # what the host lanes share: the measured copy
    assert host == pytest.approx(STREAM)
    overheads = dict(spec.op_overhead)
    assert {"gpu.compute/expert_ffn", "gpu.compute/gpu_attn", "gpu.h2d/page_copy"} <= set(overheads)
    assert all(v >= 0 for v in overheads.values())
    printed = capsys.readouterr()
    assert "calibration of" in printed.out
    assert "--hardware" not in printed.err.replace(str(path), "")  # no "pass --hardware": calibrate has none
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


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_calibrate_without_cuda_refuses_the_gpu(
    device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--device cuda` (issue 27 item 9) asks for the GPU as auto does: refused, one line, without one."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["calibrate", "--device", device, "--output", str(tmp_path / "m.json")]) != 0
    err = capsys.readouterr().err
    assert "no GPU (CUDA)" in err and "Traceback" not in err
    assert not (tmp_path / "m.json").exists()
