"""The successor papers' published numbers that `flowmoe reproduce` checks (MoE-Gen, HybriMoE,
KTransformers), each with the table, figure or section it comes from. Numbers only, no simulator
settings; what the text states, never a figure read off a bar.

Left out, and why: MoE-Gen's DeepSeek-V2 236B and DeepSeek-R1 columns (no DeepSeek-V2 236B preset; R1
on C2 needs more than its 512 GB of host memory even in FP8), its Llama.cpp and vLLM rows (no flowmoe
stand-in: continuous batching, whole layers on the CPU); HybriMoE's Figs. 7 and 8 (per-length and
per-cache-ratio bars, no figures in the text) and its llama.cpp and AdapMoE baselines; KTransformers'
per-model figures (Figs. only); Fate's figures
(its evaluation text was not at hand: machines, models and memory budgets unknown; the abstract gives
only maxima over them, "up to 4.5x prefill and 4.1x decode over Load on Demand, 1.9x / 2.2x over EAP"),
and its EAP baseline (no flowmoe scheduler predicts from expert activation paths).
"""

from __future__ import annotations

MOE_GEN = "MoE-Gen (Xu et al., arXiv 2503.09716)"
# Table 3: C1 = A5000 24 GB, AMD 7453 28-core, 256 GB host; C2 = the same with 512 GB.
# Table 6: decoding throughput (tokens/s) on C2, prompt length 512, per decode length 256 / 1024.
# FlexGen* and MoE-Lightning* are MoE-Gen's own re-implementations (§5.1); all systems run prompts
# padded to the longest (§5.1). MoE-Gen(G): GPU only; MoE-Gen(H): with CPU attention.
MOE_GEN_DECODE_LENS = (256, 1024)
MOE_GEN_DECODE: dict[str, dict[str, tuple[float, float]]] = {
    "mixtral-8x7b": {"DeepSpeed": (27, 26), "FlexGen*": (33, 30), "MoE-Lightning*": (89, 78),
                     "MoE-Gen(G)": (195, 93), "MoE-Gen(H)": (469, 283)},
    "mixtral-8x22b": {"DeepSpeed": (4, 3), "FlexGen*": (5, 4), "MoE-Lightning*": (9, 6),
                      "MoE-Gen(G)": (54, 27), "MoE-Gen(H)": (91, 57)},
}  # fmt: skip
# Table 7: prefill throughput (tokens/s) on C2, prompt length 512 (MoE-Gen's G and H prefill alike).
MOE_GEN_PREFILL: dict[str, dict[str, float]] = {
    "mixtral-8x7b": {"DeepSpeed": 2621, "FlexGen*": 2199, "MoE-Lightning*": 2237, "MoE-Gen": 2790},
    "mixtral-8x22b": {"DeepSpeed": 710, "FlexGen*": 655, "MoE-Lightning*": 702, "MoE-Gen": 907},
}
# Table 9 (§A.1, on C1): decoding throughput (tokens/s) at batch sizes 1 and 32, prompt 512, decode 32.
MOE_GEN_SMALL: dict[tuple[str, int], dict[str, float]] = {
    ("deepseek-v2-lite", 1): {"DeepSpeed": 1.3, "FlexGen*": 0.9, "MoE-Lightning(p)*": 1.0, "MoE-Gen(G)": 5.0},
    ("deepseek-v2-lite", 32): {"DeepSpeed": 41, "FlexGen*": 35, "MoE-Lightning(p)*": 37, "MoE-Gen(G)": 35},
    ("mixtral-8x7b", 1): {"DeepSpeed": 0.4, "FlexGen*": 0.3, "MoE-Lightning(p)*": 0.4, "MoE-Gen(G)": 1.0},
    ("mixtral-8x7b", 32): {"DeepSpeed": 7.7, "FlexGen*": 5.2, "MoE-Lightning(p)*": 6.1, "MoE-Gen(G)": 33.6},
}

HYBRIMOE = "HybriMoE (Zhong et al., DAC 2025, arXiv 2504.05897)"
# §VI-A: RTX A6000, Xeon Gold 5220R at 10 cores; Mixtral-8x7B, DeepSeek-V2-Lite, Qwen2-57B-A14B
# (Table II), 4-bit experts (§V: Marlin); GPU expert cache ratios 25/50/75%.
HYBRIMOE_MODELS = ("mixtral-8x7b", "deepseek-v2-lite", "qwen2-57b-a14b")
HYBRIMOE_RATIOS = (0.25, 0.5, 0.75)
HYBRIMOE_LENGTHS = (32, 128, 512, 1024)  # §VI-B: prefill lengths "around 32, 128, 512 and 1024"
# §VI-B: average speedups over kTransformers across inputs and cache configurations (and models).
HYBRIMOE_OVER_KT = {"prefill": 1.33, "decode": 1.70}
# Table III: Qwen2, 25% cache ratio, the baseline (kTransformers) and all techniques: decode latency
# per token (s) and the speedup the table states.
HYBRIMOE_TABLE3_DECODE = {"kTransformers": 0.21, "HybriMoE": 0.11}
HYBRIMOE_TABLE3_SPEEDUP = 1.86
# §VI-D: MRS cache hit rates at 25% cache (Mixtral 36.2%, DeepSeek 52.7%, Qwen2 52.8%) and Mixtral at 75%.
HYBRIMOE_HIT: dict[tuple[str, float], float] = {
    ("mixtral-8x7b", 0.25): 0.362,
    ("deepseek-v2-lite", 0.25): 0.527,
    ("qwen2-57b-a14b", 0.25): 0.528,
    ("mixtral-8x7b", 0.75): 0.833,
}

KTRANSFORMERS = "KTransformers (Chen et al., SOSP 2025)"
# Abstract: "4.62-19.74x prefilling speedups and 1.25-4.09x decoding speedups compared to existing
# systems" (llama.cpp and Fiddler), without Expert Deferral. The setup as its authors state it
# (sgl-project/sglang#11425): dual Xeon Platinum 8452Y, 1 TB DDR5, an A100 40 GB for the full-precision
# models; DeepSeek-V3, DeepSeek-V2.5 and Qwen2-57B-A14B.
KTRANSFORMERS_OVER_EXISTING = {"prefill": (4.62, 19.74), "decode": (1.25, 4.09)}
KTRANSFORMERS_MODELS = ("deepseek-v3", "qwen2-57b-a14b")  # DeepSeek-V2.5 has no preset
# Abstract: Expert Deferral "yields up to 1.45x additional throughput beyond the aforementioned
# optimizations, with an average model accuracy drop of no more than 0.5%".
KTRANSFORMERS_DEFERRAL = 1.45

FATE = "Fate (Fang et al., arXiv 2502.12224)"
# Abstract: "compared to Load on Demand and Expert Activation Path-based method, Fate achieves up to 4.5x
# and 1.9x speedups in prefill speed and up to 4.1x and 2.2x speedups in decoding speed, respectively";
# maxima over its models (Qwen1.5-MoE, DeepSeekMoE) and memory budgets. Only the Load on Demand pair
# has a flowmoe stand-in.
FATE_OVER_ON_DEMAND = {"prefill": 4.5, "decode": 4.1}
FATE_OVER_EAP = {"prefill": 1.9, "decode": 2.2}
# Abstract: the shallow-favouring cache "increases the expert hit rate to 99%".
FATE_HIT = 0.99
FATE_MODEL = "qwen1.5-moe-a2.7b"  # DeepSeekMoE 16B has no preset
