"""Hardware presets: the papers' machines and the GPUs people offload on, each with its host.

Units: capacities in GiB (2**30 bytes), bandwidths in decimal GB/s (1e9 bytes/s), compute in
flop/s. Each preset keeps the datasheet peaks and adds the sustained figures the cost model
uses; `HardwareSpec.sources` says where each sustained figure comes from. A figure marked
"estimate" is a judgement from the cited evidence, not a measurement of that machine. No
figure is fitted to a paper's end-to-end throughput: those are what the simulator is checked
against.
"""

from __future__ import annotations

from attrs import evolve

from flowmoe.core.consumer_presets import CONSUMER, RTX4090
from flowmoe.core.hardware import GB, GiB, HardwareSpec
from flowmoe.core.preset_parts import (
    AMD_CORE,
    GDDR,
    GEN3,
    GEN4,
    GEN5,
    HASWELL_CORE,
    HBM,
    LARGE,
    MESH_XEON_CORE,
    ML_FIG9,
    NVME,
    PINNED,
    S2_KV_BYTES,
    ZEN4_CORE,
    Figure,
    Gpu,
    Host,
    Link,
    machine,
)

# --- GPUs (datasheet peaks) -----------------------------------------------------------------
T4 = Gpu(
    "T4",
    65e12,
    8.1e12,
    320 * GB,
    16 * GiB,
    Figure(
        220 / 320,
        "Jia et al., 'Dissecting the NVidia Turing T4 GPU via Microbenchmarking' "
        "(arXiv:1903.07486): 220 GB/s of 320 measured",
    ),
    Figure(
        21.24 / 65,
        "FlexGen's GCP-T4 cost model (FMInference/FlexiGen experimental/cost_model.py, mm_flops_p): "
        "matmul 21.24 TFLOPS of 65 (fitted to FlexGen's "
        "own OPT runs, not to the papers checked here); the T4's 70 W cap throttles its "
        "clock under tensor load (Jia et al. 2019)",
    ),
    "NVIDIA T4 datasheet: 65 TFLOPS fp16 tensor, 8.1 fp32, 320 GB/s GDDR6, 16 GB",
)
L4 = Gpu(
    "L4",
    121e12,
    30.3e12,
    300 * GB,
    24 * GiB,
    GDDR,
    Figure(
        0.5,
        "estimate: a 72 W card like the T4 (which sustains 0.33) throttles under tensor load; "
        "between the T4 and full-power cards",
    ),
    "NVIDIA L4 datasheet: 242 TFLOPS fp16 tensor with sparsity (121 dense), 30.3 fp32, 300 GB/s, 24 GB",
)
A10G = Gpu(
    "A10G",
    125e12,
    31.2e12,
    600 * GB,
    24 * GiB,
    GDDR,
    LARGE,
    "NVIDIA A10 datasheet (AWS publishes no A10G tensor figure): 125 TFLOPS fp16 tensor dense, "
    "31.2 fp32, 600 GB/s, 24 GB",
)
A5000 = Gpu(
    "RTX A5000",
    111.1e12,
    27.8e12,
    768 * GB,
    24 * GiB,
    GDDR,
    LARGE,
    "NVIDIA RTX A5000 datasheet: 222.2 TFLOPS tensor with sparsity (111.1 dense), 27.8 fp32, 768 GB/s, 24 GB",
)
A6000 = Gpu(
    "RTX A6000",
    154.8e12,
    38.7e12,
    768 * GB,
    48 * GiB,
    GDDR,
    LARGE,
    "NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor with sparsity (154.8 dense), 38.7 fp32, 768 GB/s, 48 GB",
)
A40 = Gpu(
    "A40",
    149.7e12,
    37.4e12,
    696 * GB,
    48 * GiB,
    GDDR,
    LARGE,
    "NVIDIA A40 datasheet: 149.7 TFLOPS fp16 tensor dense, 37.4 fp32, 696 GB/s, 48 GB",
)
L40S = Gpu(
    "L40S",
    362.05e12,
    91.6e12,
    864 * GB,
    48 * GiB,
    GDDR,
    LARGE,
    "NVIDIA L40S datasheet: 362.05 TFLOPS fp16 tensor dense (733 sparse), 91.6 fp32, 864 GB/s, 48 GB",
)
A100_40 = Gpu(
    "A100-SXM4-40GB",
    312e12,
    19.5e12,
    1555 * GB,
    40 * GiB,
    HBM,
    LARGE,
    "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 19.5 fp32, 1555 GB/s HBM2, 40 GB",
)
A100_80 = Gpu(
    "A100-SXM4-80GB",
    312e12,
    19.5e12,
    2039 * GB,
    80 * GiB,
    HBM,
    LARGE,
    "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 19.5 fp32, 2039 GB/s HBM2e, 80 GB",
)
H100 = Gpu(
    "H100-SXM",
    989e12,
    67e12,
    3350 * GB,
    80 * GiB,
    HBM,
    LARGE,
    "NVIDIA H100 datasheet (SXM): 989 TFLOPS bf16 dense, 67 fp32, 3.35 TB/s HBM3, 80 GB",
)
H800 = evolve(
    H100,
    name="H800-SXM",
    datasheet="NVIDIA H800 SXM (H100 SXM compute and memory, NVLink cut to 400 GB/s): 989 TFLOPS bf16 "
    "dense, 3.35 TB/s, 80 GB",
)
H200 = Gpu(
    "H200-SXM",
    989e12,
    67e12,
    4800 * GB,
    141 * GiB,
    HBM,
    LARGE,
    "NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 67 fp32, 4.8 TB/s HBM3e, 141 GB (GPU memory "
    "'GB' is GiB, as for every card here: nvidia-smi shows 143771 MiB)",
)
RTX3090 = Gpu(
    "RTX 3090",
    71e12,
    35.6e12,
    936 * GB,
    24 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GA102 whitepaper: RTX 3090 71 TFLOPS fp16 tensor with fp32 accumulate, 35.6 fp32, "
    "936 GB/s, 24 GB",
)
RTX5090 = Gpu(
    "RTX 5090",
    209.5e12,
    104.8e12,
    1792 * GB,
    32 * GiB,
    GDDR,
    LARGE,
    "NVIDIA RTX Blackwell whitepaper: RTX 5090 209.5 TFLOPS fp16 tensor dense, 104.8 fp32, "
    "1792 GB/s GDDR7, 32 GB",
)
QUADRO_RTX6000 = Gpu(
    "Quadro RTX 6000",
    130.5e12,
    16.3e12,
    672 * GB,
    24 * GiB,
    GDDR,
    LARGE,
    "NVIDIA Quadro RTX 6000 datasheet: 130.5 TFLOPS tensor, 16.3 fp32, 672 GB/s, 24 GB "
    "(Fiddler Table 1: 24576 MiB)",
)
RTX6000_ADA = Gpu(
    "RTX 6000 Ada",
    364.2e12,
    91.1e12,
    960 * GB,
    48 * GiB,
    GDDR,
    LARGE,
    "NVIDIA RTX 6000 Ada datasheet: 1457 TFLOPS fp8 sparse (364.2 fp16 dense), 91.1 fp32, "
    "960 GB/s, 48 GB (Fiddler Table 1: 49140 MiB)",
)

# --- Host links --------------------------------------------------------------------------------
S2_LINK = Link(31.5 * GB, Figure(S2_KV_BYTES / 0.17388, (
    f"{ML_FIG9}: one layer's KV cache of 256 x 2048 tokens (2.15 GB) from pinned memory to the L4 in "
    "173.9 ms on MoE-Lightning's S2 host (GCP G2) = 12.35 GB/s; 11.9 GB/s at its smallest (16.8 MB)"
)), "PCIe 4.0 x16 on a GCP G2 host, as measured there")  # fmt: skip
COLLAB_LINK = Link(31.5 * GB, Figure(704.6e6 / 28.0e-3, (
    "collaborative-inference paper, Table I: two Mixtral experts (704.6 MB) over its PCIe 4.0 x16 in 28.0 ms"
)), "PCIe 4.0 x16")  # fmt: skip
KLOTSKI_ENV1_LINK = Link(31.5 * GB, Figure(352.3e6 / 21e-3, (
    "Klotski §2: one Mixtral expert (352.3 MB) takes about 21 ms to transmit on its RTX 3090 host"
)), "PCIe 4.0 x16")  # fmt: skip
PREGATED_LINK = Link(32 * GB, Figure(0.8 * 32 * GB, f"{PINNED}; applied to the 32 GB/s Pre-gated §V states"),
                     "PCIe 4.0 at 32 GB/s (Pre-gated MoE §V, as stated)")  # fmt: skip

# --- Hosts (datasheet: cores x clock x fp32 flop/cycle; channels x MT/s x 8 B) ---------------------
S1_HOST = Host(
    "MoE-Lightning Table 2 S1: Intel Xeon @ 2.30 GHz (GCP N1 Haswell), 24 vCPU = 12 cores, 192 GB; "
    "12 x 2.3 GHz x 32 (AVX2 FMA) = 0.88 TFLOP/s (the artifact's HardwareConfig: 0.8); Haswell-EP "
    "4 x DDR4-2133 = 68.3 GB/s per socket (the artifact's launch script passes --cpu-mem-bdw 100 GiB/s "
    "for every setting, more than one Haswell socket can deliver, so the socket's datasheet is kept)",
    0.88e12,
    68.3 * GB,
    192 * GiB,
    NVME,
    12,
    HASWELL_CORE,
)
S2_HOST = Host(
    "MoE-Lightning Table 2 S2: Intel Xeon @ 2.20 GHz (GCP G2 Cascade Lake), 24 vCPU = 12 cores, 192 GB; "
    "12 x 2.2 GHz x 64 (AVX-512) = 1.69 TFLOP/s; 6 x DDR4-2933 = 140.8 GB/s (the artifact's likwid-bench "
    "load_mem figure, --cpu-mem-bdw 100 GiB/s = 107 GB/s, is 0.76 of it: caoshiyi/artifacts "
    "benchmarks/cpu_profile/mem_bdw.sh, benchmarks/mtbench/launch_server.sh)",
    1.69e12,
    140.8 * GB,
    192 * GiB,
    NVME,
    12,
    MESH_XEON_CORE,
)
S6_HOST = Host(
    "MoE-Lightning Table 2 S6-S9: Intel Xeon @ 2.30 GHz (GCP N1 Haswell), 32 vCPU = 16 cores, 416 GB; "
    "16 x 2.3 GHz x 32 = 1.18 TFLOP/s; 4 x DDR4-2133 = 68.3 GB/s",
    1.18e12,
    68.3 * GB,
    416 * GiB,
    NVME,
    16,
    HASWELL_CORE,
)
KLOTSKI_ENV1_HOST = Host(
    "Klotski Table 2 Env1: Xeon Gold 5318Y (24 cores, 2.1 GHz, AVX-512: 3.2 TFLOP/s; "
    "8 x DDR4-2933 = 187.7 GB/s), 256 GB",
    3.2e12,
    187.7 * GB,
    256 * GiB,
    Figure(1 * GB, "Klotski Table 2 Env1: disk read 1 GB/s"),
    24,
    MESH_XEON_CORE,
)
KLOTSKI_ENV2_HOST = Host(
    "Klotski Table 2 Env2: Xeon Platinum 8470 (52 cores, 2.0 GHz, AVX-512: 6.7 TFLOP/s; "
    "8 x DDR5-4800 = 307.2 GB/s), 800 GB",
    6.7e12,
    307.2 * GB,
    800 * GiB,
    NVME,
    52,
    MESH_XEON_CORE,
)
FIDDLER_ENV1_HOST = Host(
    "Fiddler Table 1 Env1: Xeon Gold 6126, 48 threads = 2 sockets x 12 cores, 2.6 GHz, "
    "AVX-512: 4.0 TFLOP/s; 2 x 6 x DDR4-2666 = 256 GB/s; memory not stated, assumed 192 GiB",
    4.0e12,
    256 * GB,
    192 * GiB,
    NVME,
    24,
    MESH_XEON_CORE,
)
FIDDLER_ENV2_HOST = Host(
    "Fiddler Table 1 Env2: Xeon Platinum 8480+, 112 cores = 2 sockets x 56, 2.0 GHz, "
    "AVX-512: 14.3 TFLOP/s; 2 x 8 x DDR5-4800 = 614.4 GB/s; memory not stated, assumed 512 GiB",
    14.3e12,
    614.4 * GB,
    512 * GiB,
    NVME,
    112,
    MESH_XEON_CORE,
)
COLLAB_HOST = Host(
    "collaborative-inference paper §IV: Threadripper 7960X, 24 cores at 4.8-5.3 GHz "
    "(24 x 4.8 GHz x 32 = 3.7 TFLOP/s), 4 x DDR5-5200 = 166.4 GB/s; memory not stated, "
    "assumed 256 GiB",
    3.7e12,
    166.4 * GB,
    256 * GiB,
    NVME,
    24,
    ZEN4_CORE,
)
PREGATED_HOST = Host(
    "Pre-gated MoE §V: AMD EPYC 7V12, 64 cores at 2.45 GHz (x 32 = 5.0 TFLOP/s), "
    "8 x DDR4-3200 = 204.8 GB/s, 1.8 TB",
    5.0e12,
    204.8 * GB,
    1800 * GiB,
    NVME,
    64,
    AMD_CORE,
)
AWS_G5_HOST = Host(
    "AWS g5.16xlarge (typical A10G host): 64 vCPU = 32 cores of an EPYC 7R32 at 2.8 GHz "
    "(x 32 = 2.9 TFLOP/s), 8 x DDR4-3200 = 204.8 GB/s, 256 GiB",
    2.9e12,
    204.8 * GB,
    256 * GiB,
    NVME,
    32,
    AMD_CORE,
)
WORKSTATION = Host(
    "assumed workstation host: Threadripper PRO 5975WX, 32 cores at 3.6 GHz (x 32 = 3.7 TFLOP/s), "
    "8 x DDR4-3200 = 204.8 GB/s, 256 GiB",
    3.7e12,
    204.8 * GB,
    256 * GiB,
    NVME,
    32,
    AMD_CORE,
)
SERVER_DDR4 = Host(
    "assumed server host: one EPYC 7763 socket, 64 cores at 2.45 GHz (x 32 = 5.0 TFLOP/s), "
    "8 x DDR4-3200 = 204.8 GB/s, 512 GiB",
    5.0e12,
    204.8 * GB,
    512 * GiB,
    NVME,
    64,
    AMD_CORE,
)
SERVER_DDR5 = Host(
    "assumed server host: one Xeon Platinum 8480+ socket, 56 cores at 2.0 GHz (AVX-512: "
    "7.2 TFLOP/s), 8 x DDR5-4800 = 307.2 GB/s, 1024 GiB",
    7.2e12,
    307.2 * GB,
    1024 * GiB,
    NVME,
    56,
    MESH_XEON_CORE,
)
DESKTOP_DDR4 = Host(
    "assumed desktop host: 16 cores (AVX2, 1.7 TFLOP/s), 2 x DDR4-3200 = 51.2 GB/s, 128 GiB",
    1.7e12,
    51.2 * GB,
    128 * GiB,
    NVME,
    16,
    AMD_CORE,
)
DESKTOP_DDR5 = Host(
    "assumed desktop host: 16 cores (2.0 TFLOP/s), 2 x DDR5-5600 = 89.6 GB/s, 128 GiB",
    2.0e12,
    89.6 * GB,
    128 * GiB,
    NVME,
    16,
    AMD_CORE,
)


T4_P2P = Figure(0.8 * 15.75 * GB, (
    "T4 has no NVLink (datasheet): NCCL all-reduces cross PCIe 3.0 x16; bus bandwidth taken as the pinned "
    f"copy rate: {PINNED}"
))  # fmt: skip
A100_NVLINK = Figure(0.8 * 300 * GB, (
    "A100 SXM NVLink 3: 600 GB/s total = 300 GB/s per direction (datasheet); estimate: NCCL reaches ~80%"
))  # fmt: skip

PRESETS: dict[str, HardwareSpec] = {
    # MoE-Lightning (Table 2). `t4` and `l4` are its S1 and S2 machines.
    "t4": machine("t4", T4, S1_HOST, GEN3),
    "l4": machine("l4", L4, S2_HOST, S2_LINK),
    "2xt4": machine("2xt4", T4, S6_HOST, GEN3, 2, T4_P2P),
    "4xt4": machine("4xt4", T4, S6_HOST, GEN3, 4, T4_P2P),
    # Klotski (Table 2), Fiddler (Table 1), collaborative inference (§IV), Pre-gated MoE (§V).
    "klotski-env1": machine("klotski-env1", RTX3090, KLOTSKI_ENV1_HOST, KLOTSKI_ENV1_LINK),
    "klotski-env2": machine("klotski-env2", H800, KLOTSKI_ENV2_HOST, GEN5),
    "fiddler-env1": machine("fiddler-env1", QUADRO_RTX6000, FIDDLER_ENV1_HOST, GEN3),
    "fiddler-env2": machine("fiddler-env2", RTX6000_ADA, FIDDLER_ENV2_HOST, GEN4),
    "collab-4090": machine("collab-4090", RTX4090, COLLAB_HOST, COLLAB_LINK),
    "pregated-a100": machine("pregated-a100", A100_80, PREGATED_HOST, PREGATED_LINK),
    # GPUs people offload on, each with a typical host.
    "a10g": machine("a10g", A10G, AWS_G5_HOST, GEN4),
    "a5000": machine("a5000", A5000, WORKSTATION, GEN4),
    "a6000": machine("a6000", A6000, WORKSTATION, GEN4),
    "a40": machine("a40", A40, SERVER_DDR4, GEN4),
    "l40s": machine("l40s", L40S, SERVER_DDR4, GEN4),
    "a100-40": machine("a100-40", A100_40, SERVER_DDR4, GEN4),
    "a100-80": machine("a100-80", A100_80, SERVER_DDR4, GEN4),
    "2xa100-80": machine("2xa100-80", A100_80, SERVER_DDR4, GEN4, 2, A100_NVLINK),
    "h100": machine("h100", H100, SERVER_DDR5, GEN5),
    "h200": machine("h200", H200, SERVER_DDR5, GEN5),
    "rtx3090": machine("rtx3090", RTX3090, DESKTOP_DDR4, GEN4),
    "rtx4090": machine("rtx4090", RTX4090, DESKTOP_DDR5, GEN4),
    "rtx5090": machine("rtx5090", RTX5090, DESKTOP_DDR5, GEN5),
}
# The successor papers' machines (`flowmoe reproduce moe-gen | hybrimoe | ktransformers | fate`).
MOE_GEN_C1 = Host(
    "MoE-Gen Table 3 (C1; C2 the same with 512 GB): AMD EPYC 7453, 28 cores at 2.75 GHz (Zen 3 AVX2, x 32 = "
    "2.46 TFLOP/s), 8 x DDR4-3200 = 204.8 GB/s, 256 GB; Fig. 3: the A5000 over PCIe 4.0",
    2.46e12,
    204.8 * GB,
    256 * GiB,
    NVME,
    28,
    AMD_CORE,
)
HYBRIMOE_HOST = Host(
    "HybriMoE §VI-A: Xeon Gold 5220R limited to 10 cores (10 x 2.2 GHz x 64 AVX-512 = 1.41 TFLOP/s), "
    "6 x DDR4-2666 = 128 GB/s; memory not stated, assumed 256 GiB; Cascade Lake's PCIe 3.0 link",
    1.41e12,
    128 * GB,
    256 * GiB,
    NVME,
    10,
    MESH_XEON_CORE,
)
KTRANSFORMERS_HOST = Host(
    "KTransformers (SOSP '25) setup as its authors state it (sgl-project/sglang#11425): dual Xeon Platinum "
    "8452Y, 2 x 36 cores at 2.0 GHz (AVX-512: 9.2 TFLOP/s), 2 x 8 x DDR5-4800 = 614.4 GB/s, 1 TB; "
    "the A100 over PCIe 4.0",
    9.2e12,
    614.4 * GB,
    1024 * GiB,
    NVME,
    72,
    MESH_XEON_CORE,
)
PRESETS.update({
    "moe-gen-c1": machine("moe-gen-c1", A5000, MOE_GEN_C1, GEN4),
    "moe-gen-c2": machine("moe-gen-c2", A5000, evolve(MOE_GEN_C1, cpu_memory=512 * GiB), GEN4),
    "hybrimoe-a6000": machine("hybrimoe-a6000", A6000, HYBRIMOE_HOST, GEN3),
    "ktransformers-a100": machine("ktransformers-a100", A100_40, KTRANSFORMERS_HOST, GEN4),
})  # fmt: skip
GTX1080TI = Gpu(
    "GTX 1080 Ti",
    11.34e12,
    11.34e12,
    484 * GB,
    11 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GeForce GTX 1080 Ti specifications: 3584 CUDA cores at 1582 MHz boost = 11.34 TFLOPS fp32, "
    "484 GB/s GDDR5X, 11 GB, PCIe 3.0 x16; Pascal GP102 has no tensor cores and runs fp16 at 1/64 "
    "rate, so half-precision GEMMs are taken at the fp32 peak (cuBLAS with fp32 compute)",
)
# Fate (arXiv 2502.12224): the 11 GB RTX 1080 Ti its introduction names as the edge GPU; its host is not
# at hand, so the assumed desktop DDR4 host stands in.
PRESETS["fate-1080ti"] = machine("fate-1080ti", GTX1080TI, DESKTOP_DDR4, GEN3)
PRESETS.update(CONSUMER)  # desktop and laptop GeForce cards on desktop and laptop hosts
ALIASES = {"moe-lightning-s1": "t4", "moe-lightning-s2": "l4", "moe-lightning-s6": "2xt4",
           "moe-lightning-s7": "4xt4"}  # fmt: skip
PRESETS.update({alias: evolve(PRESETS[target], name=alias) for alias, target in ALIASES.items()})
