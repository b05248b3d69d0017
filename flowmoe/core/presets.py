"""Paper-scale model presets: the real config.json fields of published MoE models.

A preset gives the real shapes without weights (flowmoe fills them with random
values), so large-model schedules, memory budgets and costs can be studied
anywhere. DBRX is modelled with its real shapes and Mixtral's numerics (RMSNorm
for its bias-free LayerNorm), since only the shapes matter for scheduling.
"""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.spec import ModelSpec


def _mixtral(vocab: int, hidden: int, layers: int, heads: int, experts: int, top_k: int, inter: int,
             theta: float = 1e6, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "architectures": ["MixtralForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "head_dim": 128, "num_local_experts": experts, "num_experts_per_tok": top_k,
        "intermediate_size": inter, "rope_theta": theta, "rms_norm_eps": 1e-5, "dtype": "bfloat16",
        "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 2, **extra,
    }  # fmt: skip


PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": _mixtral(32000, 4096, 32, 32, 8, 2, 14336),
    "mixtral-8x22b": _mixtral(32768, 6144, 56, 48, 8, 2, 16384),
    "dbrx": _mixtral(100352, 6144, 40, 48, 16, 4, 10752, theta=5e5, clip_qkv=8.0),
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "intermediate_size": 5632, "norm_topk_prob": False,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "dtype": "bfloat16", "max_position_embeddings": 8192,
        "eos_token_id": 151643,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
        "norm_topk_prob": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
        "max_position_embeddings": 40960, "eos_token_id": 151645,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 1024, "rope_theta": 1e4,
        "rms_norm_eps": 1e-5, "dtype": "bfloat16", "max_position_embeddings": 4096, "eos_token_id": 50279,
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 2880, "sliding_window": 128,
        "rms_norm_eps": 1e-5, "dtype": "bfloat16", "max_position_embeddings": 131072, "eos_token_id": 200002,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    },
}  # fmt: skip
PRESET_CONFIGS["gpt-oss-120b"] = {
    **PRESET_CONFIGS["gpt-oss-20b"],
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}

PRESETS = tuple(PRESET_CONFIGS)


def preset(name: str, layers: int | None = None, dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of a preset, optionally cut to `layers` layers and cast to `dtype`."""
    if name not in PRESET_CONFIGS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    spec = ModelSpec.from_hf({**PRESET_CONFIGS[name], "_name_or_path": name})
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers must be at least 1, got {layers}")
        spec = spec.with_layers(layers)
    return spec.with_dtype(dtype) if dtype else spec
