"""HardwareSpec: what a GPU + CPU host peaks at and what it sustains; saved profiles.

Units, everywhere in flowmoe: capacities in bytes, written in GiB (2**30) in the presets;
bandwidths in bytes/s, written in decimal GB/s (1e9); compute in flop/s; fixed costs in seconds.

A spec keeps the datasheet peaks (`gpu_flops`, `gpu_bandwidth`, `cpu_flops`, `cpu_bandwidth`,
`link_peak`) and adds what the hardware sustains: the share of the GPU's tensor peak a GEMM
reaches at a given number of rows (`gemm_efficiency`), the share of memory bandwidth streaming
kernels reach, pinned and pageable copy bandwidth, CPU GEMM / attention bandwidth as a share of
DRAM peak and what one core streams, launch, copy and synchronisation costs, the host's time to
issue each GPU kernel and each CPU op, and for several GPUs run tensor parallel the interconnect
their all-reduces cross. `sources` names where each sustained figure comes from.
The presets live in `hardware_presets.py`; a profile is a JSON file `flowmoe calibrate`
measured on a real machine. Every command that needs a cost model takes either, through
`hardware(name_or_path)`.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path
from typing import Any

from attrs import NOTHING, asdict, fields, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.jsonfile import read_json_object
from flowmoe.core.write_guard import DEFAULT_GUARD, Guard, OutputKind

GiB = 2**30
GB = 10**9
PROFILE_FORMAT = "flowmoe-hardware/1"
PROFILE = OutputKind("hardware profile", f'{{\n  "format": "{PROFILE_FORMAT}"'.encode())
# Figures a preset states as sustained (not datasheet); each needs an entry in `sources`.
SUSTAINED = (
    "gemm_efficiency", "gpu_memory_efficiency", "h2d_bandwidth", "d2h_bandwidth", "h2d_pageable_bandwidth",
    "d2h_pageable_bandwidth", "cpu_gemm_efficiency", "cpu_attention_efficiency", "cpu_compute_efficiency",
    "gpu_launch", "cpu_launch", "copy_latency", "sync_latency", "disk_bandwidth", "host_dispatch",
    "cpu_op_dispatch", "cpu_core_bandwidth", "cpu_memory_efficiency",
)  # fmt: skip
MULTI_GPU = ("interconnect_bandwidth", "interconnect_latency")


@frozen
class HardwareSpec:
    """Throughput in flop/s and bytes/s, memory in bytes, fixed costs in seconds.

    `gpu_flops` (dense 16-bit tensor) and `gpu_bandwidth` are one GPU's datasheet peaks;
    `gpu_memory` is the memory of all `gpus` GPUs together (what a policy's budget covers).
    `h2d_bandwidth` / `d2h_bandwidth` are sustained pinned copies over one GPU's link (each GPU
    has its own); the pageable figures default to the pinned ones. Efficiencies default to 1.0,
    so a calibrated profile (which measures sustained figures directly) is priced as measured.

    `*_roofline` is a measured roofline: (intensity in flop/B, flop/s) points of matmuls at
    growing row counts, which replaces the datasheet roofline where present;
    `*_attention_roofline` is the same for the attention kernel; `op_overhead` maps `lane/op`
    (e.g. `cpu.compute/expert_ffn`) to a measured fixed cost that replaces the launch cost.

    Per kernel (the cost model knows how many kernels each op stands for): `host_dispatch` is the
    host's time to issue one GPU kernel (framework dispatch + launch), so a GPU node takes at least
    its kernels x that; `cpu_op_dispatch` is added per op of a CPU node. `cpu_cores` x
    `cpu_core_bandwidth` caps what CPU streaming work reaches below the DRAM figure (0: no cap)."""

    name: str
    gpu_flops: float
    gpu_bandwidth: float
    gpu_memory: int
    cpu_flops: float
    cpu_bandwidth: float
    cpu_memory: int
    h2d_bandwidth: float
    d2h_bandwidth: float
    disk_bandwidth: float = 2e9  # 0: no disk tier
    gpu_launch: float = 10e-6  # fixed cost of a GPU node (its kernel launches)
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
    gpu_fp32_flops: float | None = None  # datasheet fp32 (non-tensor) peak; None: gpu_flops
    gemm_efficiency: tuple[tuple[float, float], ...] = ()  # (rows, share of peak flop/s); (): 1.0
    gpu_memory_efficiency: float = 1.0  # share of gpu_bandwidth streaming kernels reach
    cpu_gemm_efficiency: float = 1.0  # share of cpu_bandwidth a CPU GEMM streaming weights reaches
    cpu_attention_efficiency: float = 1.0  # share of cpu_bandwidth CPU attention reaches
    cpu_compute_efficiency: float = 1.0  # share of cpu_flops compute-bound CPU work reaches
    cpu_memory_efficiency: float = 1.0  # share of cpu_bandwidth all cores together stream (STREAM)
    sync_latency: float = 0.0  # a host-device synchronisation point (stream/event wait)
    host_dispatch: float = 0.0  # host time to issue one GPU kernel; a node's kernels x this bounds it
    cpu_op_dispatch: float = 0.0  # host time per op of a CPU node (eager dispatch, OpenMP fork/join)
    cpu_cores: int = 0  # physical cores CPU work runs on; 0: no per-core cap
    cpu_core_bandwidth: float = 0.0  # bytes/s one core streams from DRAM; 0: no per-core cap
    link_peak: float | None = None  # datasheet host link bandwidth per direction
    gpus: int = 1  # GPUs run tensor parallel
    interconnect_bandwidth: float = 0.0  # GPU-GPU bytes/s per direction (all-reduce bus bandwidth)
    interconnect_latency: float = 0.0  # fixed cost of one all-reduce
    sources: tuple[tuple[str, str], ...] = ()  # (field, where its figure comes from)

    def __attrs_post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"{self.name}: gpus must be at least 1, got {self.gpus}")
        if self.gpus > 1 and self.interconnect_bandwidth <= 0:
            raise ConfigError(f"{self.name}: {self.gpus} GPUs need an interconnect_bandwidth")

    def gemm_share(self, rows: float) -> float:
        """Share of the tensor peak a GEMM of `rows` rows (tokens per expert) sustains,
        interpolated linearly in log(rows) between the table's points, flat outside them."""
        table = self.gemm_efficiency
        if not table:
            return 1.0
        if rows <= table[0][0]:
            return table[0][1]
        if rows >= table[-1][0]:
            return table[-1][1]
        k = bisect.bisect_right([r for r, _ in table], rows)
        (r0, e0), (r1, e1) = table[k - 1], table[k]
        w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
        return e0 + w * (e1 - e0)

    def cpu_stream_bandwidth(self, efficiency: float, threads: int | None = None) -> float:
        """What CPU work streaming from DRAM sustains: the DRAM peak x the kernel's `efficiency`,
        capped by what the cores it runs on stream (each at most `cpu_core_bandwidth`); `threads`
        (a run's CPU threads) limits the cores used."""
        dram = self.cpu_bandwidth * efficiency
        cores = self.cpu_cores
        if threads:
            cores = min(cores, threads) if cores else threads
        if cores <= 0 or self.cpu_core_bandwidth <= 0:
            return dram
        return min(dram, cores * self.cpu_core_bandwidth)

    def cpu_share(self, threads: int | None = None) -> float:
        """Share of the CPU's cores a run with `threads` CPU threads uses (1.0: all, or not known)."""
        if not threads or not self.cpu_cores:
            return 1.0
        return min(1.0, threads / self.cpu_cores)

    def peak_flops(self, dtype_bytes: int = 2) -> float:
        """One GPU's datasheet peak for matmuls in that element size (4: fp32, else 16-bit tensor)."""
        if dtype_bytes >= 4 and self.gpu_fp32_flops:
            return self.gpu_fp32_flops
        return self.gpu_flops

    @property
    def pageable_h2d(self) -> float:
        """Pageable host -> device copies: never faster than pinned ones."""
        return min(self.h2d_pageable_bandwidth or self.h2d_bandwidth, self.h2d_bandwidth)

    @property
    def pageable_d2h(self) -> float:
        return min(self.d2h_pageable_bandwidth or self.d2h_bandwidth, self.d2h_bandwidth)

    def source_of(self, name: str) -> str:
        return dict(self.sources).get(name, "")


def hardware(name_or_path: str | Path) -> HardwareSpec:
    """A preset by name (any case: T4 is t4), or a profile JSON written by `flowmoe calibrate`."""
    from flowmoe.core.hardware_presets import PRESETS

    key = str(name_or_path)
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    path = Path(key)
    if path.exists():  # a file, or something else in its place for the reader to name
        return load_profile(path)
    if path.suffix == ".json" or os.sep in key:
        raise ConfigError(f"{path}: hardware profile not found")
    raise ConfigError(f"unknown hardware {key!r}; presets: {', '.join(PRESETS)} (or a profile JSON path)")


def __getattr__(name: str) -> Any:
    """`PRESETS` lives in hardware_presets (it builds on the types here); re-exported lazily."""
    if name == "PRESETS":
        from flowmoe.core.hardware_presets import PRESETS

        return PRESETS
    raise AttributeError(name)


def to_json(spec: HardwareSpec) -> dict[str, Any]:
    data = asdict(spec)
    data["op_overhead"] = dict(spec.op_overhead)
    data["sources"] = dict(spec.sources)
    return {"format": PROFILE_FORMAT, **data}


def save_profile(spec: HardwareSpec, path: str | Path, guard: Guard = DEFAULT_GUARD) -> Path:
    """Write through the write guard: whole, never over a file flowmoe did not write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_json(spec), indent=2)  # starts with PROFILE's marker: "format" comes first

    def produce(tmp: Path) -> None:
        tmp.write_text(text)

    return guard.write(path, PROFILE, produce)


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
        elif name == "sources":
            values[name] = _sources(value, where)
        elif name.endswith("_roofline") or name == "gemm_efficiency":
            values[name] = _curve(value, name, where)
        elif name == "cpu_cores":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: field 'cpu_cores' must be a whole number, got {value!r}")
        elif name == "gpus":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"{where}: field 'gpus' must be a whole number of at least 1, got {value!r}"
                )
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
        what = "[rows, share of peak]" if name == "gemm_efficiency" else "[flop per byte, flop/s]"
        raise ConfigError(f"{where}: field {name!r} must list {what} pairs, both positive")
    return tuple(sorted((float(i), float(f)) for i, f in value))


def _overheads(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items()
    ):
        raise ConfigError(f"{where}: field 'op_overhead' must map 'device/op' to seconds")
    return tuple(sorted((k, float(v)) for k, v in value.items()))


def _sources(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{where}: field 'sources' must map field names to text")
    return tuple(sorted(value.items()))
