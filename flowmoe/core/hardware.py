"""HardwareSpec: the throughput figures of a GPU + CPU host, named presets, and saved profiles.

A preset carries datasheet figures and says where each comes from (`source`);
a profile is a JSON file `flowmoe calibrate` measured on a real machine. Every
command that needs a cost model takes either, through `hardware(name_or_path)`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from attrs import NOTHING, asdict, evolve, fields, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.jsonfile import read_json_object

GiB = 2**30
PROFILE_FORMAT = "flowmoe-hardware/1"


@frozen
class HardwareSpec:
    """Throughput in flop/s and bytes/s, memory in bytes, fixed costs in seconds.

    Presets hold peak (datasheet) figures; a calibrated profile holds what real kernels
    reached. `*_roofline` is a measured roofline: (intensity in flop/B, flop/s) points of
    matmuls at growing row counts, which replaces min(peak, bandwidth * intensity) where
    present; `*_attention_roofline` is the same for the attention kernel (decode and
    prefill shapes); `op_overhead` maps `lane/op` (e.g. `cpu.compute/expert_ffn`) to a
    measured fixed cost that replaces the generic launch cost of that op."""

    name: str
    gpu_flops: float  # dense fp16/bf16 tensor throughput
    gpu_bandwidth: float  # HBM / GDDR
    gpu_memory: int
    cpu_flops: float
    cpu_bandwidth: float
    cpu_memory: int
    h2d_bandwidth: float  # pinned host -> device
    d2h_bandwidth: float
    disk_bandwidth: float = 2e9
    gpu_launch: float = 10e-6  # fixed cost of a GPU node (kernel launches)
    cpu_launch: float = 20e-6  # fixed cost of a CPU node (op dispatch)
    copy_latency: float = 10e-6
    h2d_pageable_bandwidth: float | None = None
    d2h_pageable_bandwidth: float | None = None
    gpu_roofline: tuple[tuple[float, float], ...] = ()
    cpu_roofline: tuple[tuple[float, float], ...] = ()
    gpu_attention_roofline: tuple[tuple[float, float], ...] = ()
    cpu_attention_roofline: tuple[tuple[float, float], ...] = ()
    op_overhead: tuple[tuple[str, float], ...] = ()
    source: str = ""

    def scaled(self, gpus: int) -> HardwareSpec:
        """`gpus` of this GPU on one host, modelled as one GPU with `gpus` times the compute,
        memory bandwidth, memory and host link (each GPU has its own PCIe link)."""
        return evolve(
            self,
            name=f"{gpus}x{self.name}",
            gpu_flops=self.gpu_flops * gpus,
            gpu_bandwidth=self.gpu_bandwidth * gpus,
            gpu_memory=self.gpu_memory * gpus,
            h2d_bandwidth=self.h2d_bandwidth * gpus,
            d2h_bandwidth=self.d2h_bandwidth * gpus,
            source=f"{gpus} x ({self.source}); tensor parallelism approximated as one larger GPU",
        )


# Host CPUs. The MoE-Lightning hosts (S1: T4, S2: L4) use the figures of the paper's own cost
# model (github.com/caoshiyi/artifacts, fastmoe/backend/utils.py HardwareConfig and the
# `--cpu-mem-bdw 100` launch flag): 0.8 / 1.6 TFLOP/s, 100 GB/s, 192 GB.
_S1_HOST = {"cpu_flops": 0.8e12, "cpu_bandwidth": 100e9, "cpu_memory": 192 * GiB}
_S2_HOST = {"cpu_flops": 1.6e12, "cpu_bandwidth": 100e9, "cpu_memory": 192 * GiB}
# Assumed hosts for GPUs the papers did not pair with one (stated in each preset's source).
_SERVER_HOST = {"cpu_flops": 2.0e12, "cpu_bandwidth": 200e9, "cpu_memory": 512 * GiB}
_DESKTOP_DDR4 = {"cpu_flops": 1.7e12, "cpu_bandwidth": 51.2e9, "cpu_memory": 128 * GiB}
_DESKTOP_DDR5 = {"cpu_flops": 2.0e12, "cpu_bandwidth": 89.6e9, "cpu_memory": 128 * GiB}
_PCIE3, _PCIE4, _PCIE5 = 12e9, 25e9, 50e9  # pinned copies reached on x16 links (theory 15.75/31.5/63)

_SERVER = "assumed host: 1 socket, 32 cores, 8-channel DDR4/5 (~200 GB/s), 2 TFLOP/s fp32, 512 GiB"
_DDR4 = "assumed host: 16-core desktop (AVX2, 1.7 TFLOP/s fp32), dual-channel DDR4-3200 51.2 GB/s, 128 GiB"
_DDR5 = "assumed host: 16-core desktop (2 TFLOP/s fp32), dual-channel DDR5-5600 89.6 GB/s, 128 GiB"


def _gpu(name: str, flops: float, bandwidth: float, memory: int, link: float, host: dict[str, Any],
         source: str) -> HardwareSpec:  # fmt: skip
    return HardwareSpec(name, flops, bandwidth, memory, h2d_bandwidth=link, d2h_bandwidth=link, source=source,
                        **host)  # fmt: skip


PRESETS: dict[str, HardwareSpec] = {
    "t4": _gpu("t4", 65e12, 320e9, 16 * GiB, _PCIE3, _S1_HOST,
               "NVIDIA T4 datasheet: 65 TFLOPS fp16 tensor, 320 GB/s GDDR6, 16 GB; PCIe 3.0 x16 ~12 GB/s "
               "pinned; host = MoE-Lightning S1 (0.8 TFLOP/s, 100 GB/s, 192 GB; artifact cost model)"),
    "l4": _gpu("l4", 121e12, 300e9, 24 * GiB, _PCIE4, _S2_HOST,
               "NVIDIA L4 datasheet: 242 TFLOPS fp16 tensor with sparsity = 121 dense, 300 GB/s, 24 GB; "
               "PCIe 4.0 x16 ~25 GB/s pinned; host = MoE-Lightning S2 (1.6 TFLOP/s, 100 GB/s, 192 GB)"),
    "a100-40": _gpu("a100-40", 312e12, 1555e9, 40 * GiB, _PCIE4, _SERVER_HOST,
                    f"NVIDIA A100 SXM4 40GB datasheet: 312 TFLOPS bf16, 1555 GB/s; PCIe 4.0; {_SERVER}"),
    "a100-80": _gpu("a100-80", 312e12, 2039e9, 80 * GiB, _PCIE4, _SERVER_HOST,
                    f"NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS bf16, 2039 GB/s; PCIe 4.0; {_SERVER}"),
    "h100": _gpu("h100", 989e12, 3350e9, 80 * GiB, _PCIE5, _SERVER_HOST,
                 f"NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s, 80 GB; PCIe 5.0; {_SERVER}"),
    "h200": _gpu("h200", 989e12, 4800e9, 141 * 10**9, _PCIE5, _SERVER_HOST,
                 f"NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s, 141 GB; PCIe 5.0; {_SERVER}"),
    "rtx3090": _gpu("rtx3090", 71e12, 936e9, 24 * GiB, _PCIE4, _DESKTOP_DDR4,
                    "NVIDIA GA102 whitepaper: RTX 3090 71 TFLOPS fp16 tensor (fp32 accumulate), 936 GB/s, "
                    f"24 GB; PCIe 4.0; {_DDR4}"),
    "rtx4090": _gpu("rtx4090", 165.2e12, 1008e9, 24 * GiB, _PCIE4, _DESKTOP_DDR5,
                    "NVIDIA Ada whitepaper: RTX 4090 165.2 TFLOPS fp16 tensor (fp32 accumulate), 1008 GB/s, "
                    f"24 GB; PCIe 4.0; {_DDR5}"),
}  # fmt: skip
PRESETS["2xt4"] = PRESETS["t4"].scaled(2)
PRESETS["4xt4"] = PRESETS["t4"].scaled(4)


def hardware(name_or_path: str | Path) -> HardwareSpec:
    """A preset by name, or a profile JSON written by `flowmoe calibrate`."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if path.is_file():
        return load_profile(path)
    if path.suffix == ".json" or os.sep in key:
        raise ConfigError(f"{path}: hardware profile not found")
    raise ConfigError(f"unknown hardware {key!r}; presets: {', '.join(PRESETS)} (or a profile JSON path)")


def to_json(spec: HardwareSpec) -> dict[str, Any]:
    data = asdict(spec)
    data["op_overhead"] = dict(spec.op_overhead)
    return {"format": PROFILE_FORMAT, **data}


def save_profile(spec: HardwareSpec, path: str | Path) -> Path:
    """Write atomically: a temporary file beside the target, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(to_json(spec), handle, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_profile(path: str | Path) -> HardwareSpec:
    data = read_json_object(Path(path))
    if data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"{path}: not a flowmoe hardware profile (expected format {PROFILE_FORMAT!r})")
    return from_json(data, str(path))


def from_json(data: dict[str, Any], where: str) -> HardwareSpec:
    known = {f.name: f for f in fields(HardwareSpec)}
    values = {k: v for k, v in data.items() if k != "format"}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}")
    missing = [n for n, f in known.items() if f.default is NOTHING and n not in values]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r}")
    for name, value in values.items():
        if name in ("name", "source"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}: field {name!r} must be a string")
        elif name == "op_overhead":
            values[name] = _overheads(value, where)
        elif name.endswith("_roofline"):
            values[name] = _curve(value, name, where)
        elif value is not None and (
            not isinstance(value, int | float) or isinstance(value, bool) or value < 0
        ):
            raise ConfigError(f"{where}: field {name!r} must be a non-negative number, got {value!r}")
    for name in ("gpu_memory", "cpu_memory"):
        values[name] = int(values[name])
    return HardwareSpec(**values)


def _curve(value: Any, name: str, where: str) -> tuple[tuple[float, float], ...]:
    ok = isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int | float) and x > 0 for x in p)
        for p in value
    )
    if not ok:
        raise ConfigError(f"{where}: field {name!r} must list [flop per byte, flop/s] pairs, both positive")
    return tuple(sorted((float(i), float(f)) for i, f in value))


def _overheads(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items()
    ):
        raise ConfigError(f"{where}: field 'op_overhead' must map 'device/op' to seconds")
    return tuple(sorted((k, float(v)) for k, v in value.items()))
