"""HardwareSpec: the throughput figures of a GPU + CPU host, and named presets."""

from __future__ import annotations

from attrs import frozen

from flowmoe.core.errors import ConfigError


@frozen
class HardwareSpec:
    """Peak figures, in flop/s and bytes/s; `*_efficiency` is the share of peak a real kernel gets."""

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
    source: str = ""


GiB = 2**30

PRESETS: dict[str, HardwareSpec] = {
    "t4": HardwareSpec(
        "t4", gpu_flops=65e12, gpu_bandwidth=300e9, gpu_memory=16 * GiB,
        cpu_flops=1.6e12, cpu_bandwidth=100e9, cpu_memory=192 * GiB, h2d_bandwidth=12e9, d2h_bandwidth=12e9,
        source="NVIDIA T4 datasheet (65 TFLOPS fp16, 320 GB/s); PCIe 3.0 x16 measured ~12 GB/s",
    ),
}  # fmt: skip


def hardware(name: str) -> HardwareSpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
