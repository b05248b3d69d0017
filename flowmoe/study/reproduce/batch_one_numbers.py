"""Published batch-1 (single-request) figures `flowmoe reproduce batch-one` checks, each with its source.
Numbers only, no simulator settings; what the text states, never a figure read off a bar.

Batch-1 figures checked elsewhere, and so not repeated here: the collaborative-inference paper's Tables
III-V (`lru-cache`: every run there serves one request), MoE-Gen's Table 9 at batch 1 (`moe-gen`),
HybriMoE's Table III per-token decode latency (`hybrimoe`) and DeepSpeed at batch 1 (`generic-offloaders`).

Left out, and why: Fiddler's Fig. 4 / Fig. 12 end-to-end and inter-token figures (bars only; its text
gives the average over llama.cpp, which has no flowmoe stand-in); the README's Environment 2 (an L4 on a
32-core Cascade Lake host, a machine no preset describes); Mixtral-offloading's own Table 2 (its experts
are 2- and 3-bit HQQ, below flowmoe's narrowest expert format); KTransformers' batch-1 figures (the
abstract's ranges are over llama.cpp and Fiddler together, checked in `ktransformers`).
"""

from __future__ import annotations

FIDDLER_README = "Fiddler README (efeslab/fiddler at 227715b: the v1 preprint's benchmarks)"
# README, opening: "unquantized Mixtral-8x7B ... with >3 token/s on a single 24GB GPU" (Environment 1:
# Quadro RTX 6000 24 GB + 48-core Intel Skylake, the paper's Table 1 Env1, Xeon Gold 6126), single
# batch; a lower bound, reached at the longer outputs of its 24 input x output configurations.
FIDDLER_README_TPS = 3.0
# README, "Benchmarks": "Compared with DeepSpeed-MII and Mixtral offloading, Fiddler is on average faster
# by 19.4 and 8.2 times for Environment 1" (mean over inputs 16-128 x outputs 16-512 tokens).
FIDDLER_README_OVER = {"DeepSpeed-MII": 19.4, "Mixtral-offloading": 8.2}

FIDDLER = "Fiddler (Kamahori et al., ICLR 2025)"
# §4.2 (Fig. 5): time to first token of a single request, prompts of 512-4096 tokens: "outperforming
# DeepSpeed-MII by 1.07 times and (Eliseev & Mazur, 2023) by 1.65 times on average across different
# configurations" (both environments).
FIDDLER_TTFT_OVER = {"DeepSpeed-MII": 1.07, "Mixtral-offloading": 1.65}
FIDDLER_TTFT_LENGTHS = (512, 1024, 2048, 4096)
# §4.1: Mixtral-offloading's `offload_per_layer` 7 on Env1 and 5 on Env2 (experts per layer kept on
# the CPU, of 8), run in 16 bits; Fiddler keeps 56 / 256 and 125 / 256 experts on the GPU (Table 1).
FIDDLER_OFFLOAD_PER_LAYER = {"Env1": 7, "Env2": 5}
FIDDLER_GPU_EXPERTS = {"Env1": 56, "Env2": 125}
