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
    # Qwen/Qwen2-57B-A14B (57B, 14B active): 64 experts top-8 and a shared expert in every layer
    "qwen2-57b-a14b": {
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 3584,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480, "intermediate_size": 18944, "norm_topk_prob": False,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "dtype": "bfloat16", "max_position_embeddings": 131072,
        "bos_token_id": 151643, "eos_token_id": 151643,
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

# The config.json of each release on the Hugging Face Hub, fields the families read.
# deepseek-ai/DeepSeek-V3 (671B; DeepSeek-R1 has the same config)
PRESET_CONFIGS["deepseek-v3"] = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "rope_theta": 10000, "bos_token_id": 0, "eos_token_id": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    "dtype": "bfloat16",
}  # fmt: skip
# moonshotai/Kimi-K2-Instruct (1T): DeepSeek-V3's architecture, 384 experts, 64 heads, one dense layer
PRESET_CONFIGS["kimi-k2"] = {
    **PRESET_CONFIGS["deepseek-v3"], "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "bos_token_id": 163584, "eos_token_id": 163585,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
}  # fmt: skip
# deepseek-ai/DeepSeek-V2-Lite (16B): no q LoRA, softmax router, greedy top-6 of 64, two shared experts
PRESET_CONFIGS["deepseek-v2-lite"] = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "rope_theta": 10000, "bos_token_id": 100000, "eos_token_id": 100001,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "dtype": "bfloat16",
}  # fmt: skip
# zai-org/GLM-4.5 (355B-A32B)
PRESET_CONFIGS["glm-4.5"] = {
    "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_shared_experts": 1,
    "n_routed_experts": 160, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": True, "max_position_embeddings": 131072, "rope_theta": 1000000,
    "rms_norm_eps": 1e-5, "eos_token_id": [151329, 151336, 151338], "dtype": "bfloat16",
}  # fmt: skip
# zai-org/GLM-4.5-Air (106B-A12B)
PRESET_CONFIGS["glm-4.5-air"] = {
    **PRESET_CONFIGS["glm-4.5"], "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 46, "n_routed_experts": 128,
    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "use_qk_norm": False,
}  # fmt: skip
# Qwen/Qwen3-235B-A22B
PRESET_CONFIGS["qwen3-235b-a22b"] = {
    **PRESET_CONFIGS["qwen3-30b-a3b"], "hidden_size": 4096, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "moe_intermediate_size": 1536,
    "intermediate_size": 12288,
}  # fmt: skip
# meta-llama/Llama-4-Scout-17B-16E-Instruct, its text_config (109B with the vision encoder, 17B active):
# 16 experts on every layer, top-1, a shared expert; every 4th layer NoPE; chunks of 8192 elsewhere
PRESET_CONFIGS["llama-4-scout"] = {
    "architectures": ["Llama4ForCausalLM"], "vocab_size": 202048, "hidden_size": 5120,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
    "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008], "dtype": "bfloat16",
}  # fmt: skip
# meta-llama/Llama-4-Maverick-17B-128E-Instruct, its text_config (400B, 17B active): 128 experts on every
# other layer (dense MLPs of 16384 between), no QK-norm, plain RoPE
PRESET_CONFIGS["llama-4-maverick"] = {
    **PRESET_CONFIGS["llama-4-scout"], "num_local_experts": 128, "interleave_moe_layer_step": 2,
    "use_qk_norm": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "max_position_embeddings": 1048576,
}  # fmt: skip
# microsoft/Phi-3.5-MoE-instruct (42B, 6.6B active). Its longrope factors (rope_scaling, 64 per list)
# are left out: they change no shape, and a checkpoint's own config.json brings them
PRESET_CONFIGS["phi-3.5-moe"] = {
    "architectures": ["PhimoeForCausalLM"], "vocab_size": 32064, "hidden_size": 4096,
    "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 16, "num_experts_per_tok": 2, "router_jitter_noise": 0.01, "attention_bias": True,
    "lm_head_bias": True, "sliding_window": 131072, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 32000, "dtype": "bfloat16",
}  # fmt: skip
# baidu/ERNIE-4.5-21B-A3B-PT (21B, 3B active): layer 0 dense, 64 experts top-6 and two shared after
PRESET_CONFIGS["ernie-4.5-21b-a3b"] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 103424, "hidden_size": 2560,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 28,
    "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128, "moe_num_experts": 64, "moe_k": 6,
    "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27,
    "moe_layer_interval": 1, "use_bias": False, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}  # fmt: skip
# ibm-granite/granite-3.0-3b-a800m-instruct (3.3B, 800M active): 40 experts top-8, tied embeddings
PRESET_CONFIGS["granite-3.0-3b-a800m"] = {
    "architectures": ["GraniteMoeForCausalLM"], "vocab_size": 49155, "hidden_size": 1536,
    "intermediate_size": 512, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
    "num_local_experts": 40, "num_experts_per_tok": 8, "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 6.0,
    "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16",
}  # fmt: skip

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
