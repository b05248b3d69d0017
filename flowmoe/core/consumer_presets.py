"""Consumer hardware presets: desktop and laptop GeForce GPUs on the desktop and laptop hosts people
offload MoE models on (issue 28): RTX 3060 12 GB, RTX 3080 Laptop GPU 16 GB, RTX 4060 8 GB, RTX 4070
12 GB and RTX 4090 24 GB, on an Intel Core i9-13900K or an AMD Ryzen 9 7950X desktop (DDR5, two
channels) or a Core i7-11800H laptop (DDR4, two channels).

Tensor peaks are dense fp16 with fp32 accumulate (what a bf16/fp16 GEMM in PyTorch runs), as the
other GeForce presets state them; NVIDIA's product pages give the sparse fp16-accumulate "Tensor
TFLOPS" (Ampere) or the sparse fp8 "AI TOPS" (Ada), 4x and 8x that figure on GeForce parts (the
RTX 3090's 285 and the RTX 4090's 1321 against the whitepapers' 71 and 165.2). A GeForce card's
link is the slower of the card's and the platform's PCIe: every card here is PCIe 4.0, so a PCIe 5.0
desktop still runs it at 4.0 (the RTX 4060 has eight lanes only). CPU peaks are cores x base clock x
fp32 flop per cycle (the sustained share is `cpu_compute_efficiency`); DRAM peaks are channels x MT/s
x 8 B. Host memory is not part of a platform's datasheet: each host states the amount it assumes.
"""

from __future__ import annotations

from attrs import evolve

from flowmoe.core.hardware import GB, GiB, HardwareSpec
from flowmoe.core.preset_parts import (
    GDDR,
    GEN4,
    LARGE,
    NVME,
    PINNED,
    ZEN4_CORE,
    Figure,
    Gpu,
    Host,
    Link,
    machine,
)

AMPERE_TENSOR = (
    "GA102 whitepaper (Appendix A): a GeForce Ampere tensor core runs 64 dense fp16 FMA per clock with "
    "fp32 accumulate (the RTX 3090: 328 tensor cores x 64 x 2 x 1.695 GHz = 71 TFLOPS)"
)
ADA_TENSOR = (
    "Ada whitepaper (Appendix A): a GeForce Ada tensor core runs 64 dense fp16 FMA per clock with fp32 "
    "accumulate (the RTX 4090: 512 tensor cores x 64 x 2 x 2.52 GHz = 165.2 TFLOPS), 1/8 of the sparse "
    "fp8 'AI TOPS' NVIDIA's product pages list"
)

RTX3060 = Gpu(
    "RTX 3060 12GB",
    25.5e12,
    12.7e12,
    360 * GB,
    12 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GeForce RTX 3060 specifications: GA106, 3584 CUDA cores, 112 tensor cores, 1.777 GHz boost "
    "(12.7 TFLOPS fp32; '101 Tensor TFLOPS' sparse fp16), 12 GB GDDR6 at 15 Gbps on 192 bits = 360 GB/s, "
    f"PCIe 4.0 x16; 112 x 64 x 2 x 1.777 GHz = 25.5 TFLOPS fp16 tensor dense ({AMPERE_TENSOR})",
)
RTX3080_LAPTOP = Gpu(
    "RTX 3080 Laptop GPU 16GB",
    42.0e12,
    21.0e12,
    448 * GB,
    16 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GeForce RTX 3080 Laptop GPU (January 2021 announcement): GA104, 48 SMs = 6144 CUDA cores and "
    "192 tensor cores, boost 1245-1710 MHz by the laptop's power limit (80 W to 150 W+), 16 GB GDDR6 on "
    "256 bits at 14 Gbps = 448 GB/s (some laptops run 12 Gbps, 384 GB/s), PCIe 4.0 x16; at the 1710 MHz "
    f"of the 150 W+ parts: 21.0 TFLOPS fp32, 192 x 64 x 2 x 1.71 GHz = 42.0 TFLOPS fp16 tensor dense "
    f"({AMPERE_TENSOR}); a lower-power laptop runs proportionally slower",
)
RTX4060 = Gpu(
    "RTX 4060 8GB",
    30.2e12,
    15.1e12,
    272 * GB,
    8 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GeForce RTX 4060 specifications: AD107, 3072 CUDA cores, 96 tensor cores, 2.46 GHz boost "
    "(15.1 TFLOPS fp32), 242 AI TOPS, 8 GB GDDR6 at 17 Gbps on 128 bits = 272 GB/s, PCIe 4.0 x8; "
    f"242 / 8 = 96 x 64 x 2 x 2.46 GHz = 30.2 TFLOPS fp16 tensor dense ({ADA_TENSOR})",
)
RTX4070 = Gpu(
    "RTX 4070 12GB",
    58.3e12,
    29.1e12,
    504 * GB,
    12 * GiB,
    GDDR,
    LARGE,
    "NVIDIA GeForce RTX 4070 specifications: AD104, 5888 CUDA cores, 184 tensor cores, 2.475 GHz boost "
    "(29.1 TFLOPS fp32), 466 AI TOPS, 12 GB GDDR6X at 21 Gbps on 192 bits = 504 GB/s, PCIe 4.0 x16; "
    f"466 / 8 = 184 x 64 x 2 x 2.475 GHz = 58.3 TFLOPS fp16 tensor dense ({ADA_TENSOR})",
)
RTX4090 = Gpu(
    "RTX 4090",
    165.2e12,
    82.6e12,
    1008 * GB,
    24 * GiB,
    GDDR,
    LARGE,
    "NVIDIA Ada whitepaper: RTX 4090 165.2 TFLOPS fp16 tensor with fp32 accumulate, 82.6 fp32, "
    "1008 GB/s, 24 GB",
)
GEN4_X8 = Link(
    15.75 * GB,
    Figure(0.8 * 15.75 * GB, f"{PINNED}; eight lanes carry half of x16's"),
    "PCIe 4.0 x8 (15.75 GB/s per direction: the card's eight lanes)",
)

CLIENT_CORE = Figure(
    ZEN4_CORE.value,
    "estimate for a Raptor Cove / Gracemont / Willow Cove client core, taken as a Zen 4 core's: "
    f"{ZEN4_CORE.source}",
)
I9_13900K = Host(
    "Intel Core i9-13900K desktop (Intel ARK): 8 P-cores at 3.0 GHz base and 16 E-cores at 2.2 GHz base, "
    "AVX2 only (P-core 2 x 256-bit FMA = 32 fp32 flop/cycle, E-core 2 x 128-bit = 16): 8 x 3.0 x 32 + "
    "16 x 2.2 x 16 = 1.33 TFLOP/s; 2 channels of DDR5-5600 = 89.6 GB/s (ARK's maximum memory bandwidth); "
    "PCIe 5.0 x16 + 4.0 x4 from the CPU; memory up to 192 GB, assumed 128 GiB",
    1.33e12,
    89.6 * GB,
    128 * GiB,
    NVME,
    24,
    CLIENT_CORE,
)
RYZEN_7950X = Host(
    "AMD Ryzen 9 7950X desktop (AMD product specifications): 16 Zen 4 cores at 4.5 GHz base (AVX-512 on "
    "2 x 256-bit FMA = 32 fp32 flop/cycle): 16 x 4.5 x 32 = 2.3 TFLOP/s; 2 channels of DDR5-5200 "
    "(its rated speed) = 83.2 GB/s; 28 PCIe 5.0 lanes (x16 for graphics); memory assumed 128 GiB",
    2.3e12,
    83.2 * GB,
    128 * GiB,
    NVME,
    16,
    ZEN4_CORE,
)
TIGER_LAKE_LAPTOP = Host(
    "assumed RTX 3080 laptop host: Intel Core i7-11800H (Intel ARK): 8 cores at 2.3 GHz base (AVX-512, "
    "one 512-bit FMA = 32 fp32 flop/cycle): 8 x 2.3 x 32 = 0.59 TFLOP/s; 2 channels of DDR4-3200 = "
    "51.2 GB/s; 20 PCIe 4.0 lanes (x16 for the GPU); memory up to 128 GB, assumed 64 GiB",
    0.59e12,
    51.2 * GB,
    64 * GiB,
    NVME,
    8,
    CLIENT_CORE,
)

_BUILT = {
    "rtx3060-i9": (RTX3060, I9_13900K, GEN4),
    "rtx3060-ryzen": (RTX3060, RYZEN_7950X, GEN4),
    "rtx4060-i9": (RTX4060, I9_13900K, GEN4_X8),
    "rtx4060-ryzen": (RTX4060, RYZEN_7950X, GEN4_X8),
    "rtx4070-i9": (RTX4070, I9_13900K, GEN4),
    "rtx4070-ryzen": (RTX4070, RYZEN_7950X, GEN4),
    "rtx4090-i9": (RTX4090, I9_13900K, GEN4),
    "rtx4090-ryzen": (RTX4090, RYZEN_7950X, GEN4),
    "rtx3080-mobile": (RTX3080_LAPTOP, TIGER_LAKE_LAPTOP, GEN4),
}
CONSUMER: dict[str, HardwareSpec] = {name: machine(name, *parts) for name, parts in _BUILT.items()}
# the names a user types without the host: the i9 desktop
CONSUMER.update(
    {short: evolve(CONSUMER[f"{short}-i9"], name=short) for short in ("rtx3060", "rtx4060", "rtx4070")}
)
