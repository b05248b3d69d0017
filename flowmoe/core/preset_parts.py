"""What every hardware preset is built from: a GPU's datasheet peaks, a host, a host link, the
sustained figures shared by every preset (each with its source), and `machine`, which puts a GPU,
a host and a link together into a `HardwareSpec`.

Units: capacities in GiB (2**30 bytes), bandwidths in decimal GB/s (1e9 bytes/s), compute in
flop/s. A figure marked "estimate" is a judgement from the cited evidence, not a measurement of
that machine. The presets themselves live in `hardware_presets` (the papers' machines and the data
centre GPUs) and `consumer_presets` (desktop and laptop GPUs on desktop and laptop hosts).
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from flowmoe.core.hardware import GB, HardwareSpec


@frozen
class Figure:
    value: float
    source: str


@frozen
class Gpu:
    name: str
    flops: float  # dense 16-bit tensor peak
    fp32: float  # fp32 (non-tensor) peak
    bandwidth: float
    memory: int
    memory_efficiency: Figure
    gemm_large: Figure  # share of `flops` a large GEMM sustains
    datasheet: str


@frozen
class Link:
    peak: float  # per direction
    pinned: Figure
    name: str


@frozen
class Host:
    description: str  # what it is and where its datasheet figures come from
    cpu_flops: float
    cpu_bandwidth: float
    cpu_memory: int
    disk: Figure
    cores: int  # physical cores (a cloud VM's vCPUs are hyperthreads: two per core)
    core_bandwidth: Figure  # what one core streams from DRAM


# --- Figures shared by every preset -------------------------------------------------------
TILES = (
    "NVIDIA Deep Learning Performance Guide, 'Matrix Multiplication Background': tensor-core GEMMs run in "
    "thread-block tiles of 64-256 rows; a GEMM with fewer rows pays for the whole tile (tile quantization), "
    "so the share of peak falls in proportion to rows below a 64-row tile"
)
PINNED = (
    "pinned copies sustain ~80% of the per-direction PCIe rate: 25.2 GB/s on PCIe 4.0 x16 (collaborative-"
    "inference paper, Table I: two Mixtral experts, 704.6 MB, in 28.0 ms on its RTX 4090 host) of 31.5; "
    "11 GB/s on PCIe 3.0 x16 (reader measurement under NVIDIA's 'How to Optimize Data Transfers in CUDA "
    "C/C++') and 12.89 GiB/s fitted by FlexGen on a GCP T4 (FMInference/FlexiGen "
    "experimental/cost_model.py, ctog_bdw) of 15.75"
)
PAGEABLE = Figure(0.4, (
    "pageable copies stage through a pinned driver buffer (CUDA C++ Best Practices Guide, 'Pinned Memory'); "
    "FlexGen's GCP-T4 constants (FMInference/FlexiGen experimental/cost_model.py) put its unpinned "
    "GPU->CPU copies at 4.82 GiB/s against "
    "12.89 GiB/s pinned CPU->GPU: 0.37 of pinned, rounded to 0.4"
))  # fmt: skip
CPU_GEMM = Figure(0.58, (
    "collaborative-inference paper, Table I: two Mixtral experts (704.6 MB bf16) on 24 threads of a "
    "Threadripper 7960X in 7.3 ms = 96.5 GB/s of its 166.4 GB/s DDR5 peak"
))  # fmt: skip
S2_KV_BYTES = 256 * 2048 * 4096  # one Mixtral layer's fp16 K and V (8 KV heads x 128) for 256 x 2048 tokens
ML_FIG9 = "MoE-Lightning §6.2, Fig. 9 (its data: caoshiyi/artifacts plots/ablation/ablation_2.py)"
CPU_ATTENTION = Figure(S2_KV_BYTES / 44.58e-3 / (140.8 * GB), (
    f"{ML_FIG9}: its CPU GQA kernel attends 256 sequences x 2048 keys of one Mixtral layer (2.15 GB of "
    "K and V) in 44.58 ms on the S2 host (24-vCPU Xeon @ 2.20 GHz) = 48.2 GB/s, 0.34 of its 140.8 GB/s "
    "DDR4 peak"
))  # fmt: skip
CPU_COMPUTE = Figure(0.7, "estimate: MKL/oneDNN SGEMM on large matrices reaches 70-90% of AVX peak")
HOST_STREAM = Figure(73.9 / 102.4, (
    "Microway, 'DDR4 Memory on Xeon E5-2600v3 with 3 DIMMs per channel': STREAM Copy 73.9 GB/s on all cores "
    "of 2 x Xeon E5-2637 v3 (Haswell-EP) over 8 channels of DDR4-1600 (102.4 GB/s): 0.72 of the DRAM peak; "
    "estimate for the other hosts (STREAM typically reaches 0.7-0.8 of peak on servers)"
))  # fmt: skip
LAUNCHES = (
    "NVIDIA Technical Blog, 'Getting Started with CUDA Graphs' (A. Gray, 2019): kernels of 2.9 us take "
    "3.8 us each launched back to back from one stream and 9.6 us each with a cudaStreamSynchronize after "
    "every one"
)
GPU_LAUNCH = Figure(5e-6, (
    f"{LAUNCHES}: ~0.9 us of GPU-side gap per kernel while the host runs ahead; a node is 3-6 kernels "
    "(cost.KERNELS): ~5 us"
))  # fmt: skip
HOST_DISPATCH = Figure(10e-6, (
    "estimate: the host's time to issue one GPU kernel from PyTorch eager (Python, binding, autograd and "
    "ATen dispatch, cudaLaunchKernel: ~5-25 us per op, 'From PyTorch op to kernel launch', "
    f"jiahuanglin.xyz GPU-kernel-serving lesson 18; {LAUNCHES}): 10 us per kernel"
))  # fmt: skip
CPU_OP = Figure(5e-6, (
    "estimate: PyTorch's eager dispatch of one CPU op (the same chain without the CUDA launch, ~5 us) with "
    "its OpenMP parallel region; the CPU runs its ops one after another, so they add up"
))  # fmt: skip
CPU_LAUNCH = Figure(30e-6, (
    "flowmoe's executor with lane threads: 32-57 us per node (bench/RESULTS.md, executor overhead)"
))  # fmt: skip
COPY_LATENCY = Figure(10e-6, "estimate: cudaMemcpyAsync issue + DMA setup, ~10 us for small copies")
SYNC = Figure(9.6e-6 - 3.8e-6 + HOST_DISPATCH.value, (
    f"{LAUNCHES}: a cudaStreamSynchronize adds 5.8 us; after it the GPU's queue is empty, so the next "
    "kernel waits for its own issue (host_dispatch)"
))  # fmt: skip
HASWELL_CORE = Figure(19.9 * GB, (
    "J. McCalpin, Intel Software Tuning forum, 'single core bandwidth: haswell vs. broadwell vs. skylake': "
    "single-thread STREAM Triad 19.9 GB/s on a 2-socket Xeon E5-2690 v3 (Haswell-EP, DDR4-2133)"
))  # fmt: skip
MESH_XEON_CORE = Figure(15 * GB, (
    "D. Lemire, 'Estimating your memory bandwidth' (2024): one thread reads 15 GB/s on an Ice Lake server; "
    "Skylake-SP and later mesh Xeons are no faster per core (P. Cordes, Stack Overflow 39260020: "
    "single-thread bandwidth is bound by line-fill buffers / latency, worse on SKX than Broadwell-EP)"
))  # fmt: skip
ZEN4_CORE = Figure(704.6e6 / 44.12e-3, (
    "collaborative-inference paper, Table III: two Mixtral experts (704.6 MB) on one thread of its "
    "Threadripper 7960X in 44.12 ms = 16.0 GB/s"
))  # fmt: skip
AMD_CORE = Figure(ZEN4_CORE.value, f"estimate for Zen 2/3 cores: {ZEN4_CORE.source}")
NVME = Figure(2 * GB, "estimate: one PCIe NVMe SSD read through the page cache, under its 3-7 GB/s datasheet")

GDDR = Figure(0.8, (
    "estimate: streaming kernels reach 69% of datasheet on a T4 (GDDR6) and 83% on a V100 (HBM2) "
    "(Jia et al., arXiv:1903.07486 and arXiv:1804.06826); 0.8 for GDDR6/6X/7 cards"
))  # fmt: skip
HBM = Figure(0.85, (
    "estimate: streaming kernels reach 83% of datasheet on a V100 (Jia et al., arXiv:1804.06826); "
    "0.85 for HBM2e/HBM3 parts"
))  # fmt: skip
LARGE = Figure(
    0.7, "estimate: large cuBLAS fp16/bf16 GEMMs on full-power cards sustain ~70% of dense tensor peak"
)


def gemm_table(large: float) -> tuple[tuple[float, float], ...]:
    return tuple((float(rows), large * rows / 64) for rows in (1, 2, 4, 8, 16, 32, 64))


# --- Host links --------------------------------------------------------------------------------
GEN3 = Link(15.75 * GB, Figure(0.8 * 15.75 * GB, PINNED), "PCIe 3.0 x16 (15.75 GB/s per direction)")
GEN4 = Link(31.5 * GB, Figure(0.8 * 31.5 * GB, PINNED), "PCIe 4.0 x16 (31.5 GB/s per direction)")
GEN5 = Link(63 * GB, Figure(0.8 * 63 * GB, PINNED), "PCIe 5.0 x16 (63 GB/s per direction)")


def machine(name: str, gpu: Gpu, host: Host, link: Link, gpus: int = 1,
            interconnect: Figure | None = None) -> HardwareSpec:  # fmt: skip
    """A preset: `gpus` x `gpu` (tensor parallel) on `host` over `link`, with every source."""
    pageable = link.pinned.value * PAGEABLE.value
    figures = {
        "gemm_efficiency": Figure(gpu.gemm_large.value, f"{gpu.gemm_large.source}; rows: {TILES}"),
        "gpu_memory_efficiency": gpu.memory_efficiency,
        "h2d_bandwidth": link.pinned, "d2h_bandwidth": link.pinned,
        "h2d_pageable_bandwidth": Figure(pageable, PAGEABLE.source),
        "d2h_pageable_bandwidth": Figure(pageable, PAGEABLE.source),
        "cpu_gemm_efficiency": CPU_GEMM, "cpu_attention_efficiency": CPU_ATTENTION,
        "cpu_compute_efficiency": CPU_COMPUTE, "cpu_memory_efficiency": HOST_STREAM, "gpu_launch": GPU_LAUNCH,
        "cpu_launch": CPU_LAUNCH, "copy_latency": COPY_LATENCY, "sync_latency": SYNC,
        "disk_bandwidth": host.disk,
        "host_dispatch": HOST_DISPATCH, "cpu_op_dispatch": CPU_OP, "cpu_core_bandwidth": host.core_bandwidth,
    }  # fmt: skip
    if interconnect is not None:
        figures["interconnect_bandwidth"] = interconnect
        figures["interconnect_latency"] = ALLREDUCE_LATENCY
    # the float fields by name; Any because **values cannot say which of HardwareSpec's fields they fill
    values: dict[str, Any] = {k: f.value for k, f in figures.items() if k != "gemm_efficiency"}
    return HardwareSpec(
        name, gpu.flops, gpu.bandwidth, gpu.memory * gpus,
        host.cpu_flops, host.cpu_bandwidth, host.cpu_memory,
        gpu_fp32_flops=gpu.fp32, gemm_efficiency=gemm_table(gpu.gemm_large.value), link_peak=link.peak,
        gpus=gpus, cpu_cores=host.cores,
        source=f"{gpus} x {gpu.datasheet}; link {link.name}; host {host.description}",
        sources=tuple(sorted((k, f.source) for k, f in figures.items())), **values,
    )  # fmt: skip


ALLREDUCE_LATENCY = Figure(30e-6, "estimate: NCCL ring all-reduce of a small message, 20-50 us over PCIe")
