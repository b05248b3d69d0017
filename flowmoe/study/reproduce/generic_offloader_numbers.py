"""Published generic-offloader figures beyond MoE-Gen's Table 9 (`generic-offloaders`, issue 28).

MoE-Infinity's README, "Performance": "Single GPU A5000 (24GB Memory), per-token-latency (seconds) for
generation" at batch 1, over a mix of LongBench, GSM8K, FLAN, BIG-Bench and MMLU prompts; the host is not
stated. EfficientMoE/MoE-Infinity README.md at d617801 (2026-03-03): the Mixtral-8x7b column unchanged
since the first README (6efc133, 2024-02-27), the DeepSeek-V2-Lite column since 3133d18 (2025-02-11).
The same table's Switch-large-128 and NLLB-MoE-54B columns are encoder-decoder models no flowmoe preset
expresses.

The README's later "Legacy comparison" table (README.md at 00181f1) keeps those figures and adds a
Qwen3-30B-A3B column (128 experts per layer), with DeepSpeed labelled "DeepSpeed (0.16.2)" and vLLM
"vLLM (v0.8.5)"; its Accelerate cell is empty.
"""

from __future__ import annotations

MOE_INFINITY = "MoE-Infinity README (EfficientMoE/MoE-Infinity README.md at d617801, 'Performance')"
# seconds per generated token, one A5000, batch 1
MOE_INFINITY_LATENCY: dict[str, dict[str, float]] = {
    "mixtral-8x7b": {"Accelerate": 6.633, "DeepSpeed": 2.486},
    "deepseek-v2-lite": {"Accelerate": 1.743, "DeepSpeed": 0.737},
}
MOE_INFINITY_LEGACY = (
    "MoE-Infinity README (EfficientMoE/MoE-Infinity README.md at 00181f1, 'Legacy comparison')"
)
# seconds per generated token, one A5000, batch 1: DeepSpeed 0.16.2 on Qwen3-30B-A3B
QWEN3_DEEPSPEED_LATENCY = 7.857

H200_ACCELERATE = (
    "bench/gpu-runs/2026-11-28-h200/gpu.jsonl (row 'accelerate-offload', NVIDIA H200, accelerate 1.15.0)"
)
# tokens/s over the whole generate call (prefill and 8 new tokens of 32 prompts), and what it ran
H200_ACCELERATE_TOKENS_PER_S = 8.04330735634564
H200_LAYERS, H200_PROMPTS, H200_LONGEST_PROMPT, H200_NEW_TOKENS = 12, 32, 187, 8
H200_MAX_MEMORY = 0.9 * 16 * 2**30  # bytes offered to infer_auto_device_map on GPU 0
