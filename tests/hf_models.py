"""Tiny random checkpoints of every supported family, written by transformers itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4, "intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 3, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "routed_scaling_factor": 2.5,
}  # fmt: skip

FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("Mixtral", {"intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2}),
    "mixtral_window": (
        "Mixtral",
        {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 7},
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        {
            "intermediate_size": 80,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 56,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        {
            "intermediate_size": 80,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "head_dim": 24,
            "norm_topk_prob": True,
        },
    ),
    "olmoe": (
        "Olmoe",
        {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 0.5},
    ),
    "gpt_oss": (
        "GptOss",
        {
            "intermediate_size": 32,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 6,
        },
    ),
    # Llama 4: MoE on layers 0 and 2 (a dense layer between), layer 2 NoPE, chunks of 5, llama3 rope
    "llama4": (
        "Llama4Text",
        {
            **{"intermediate_size": 32, "intermediate_size_mlp": 48, "head_dim": 16},
            **{"num_local_experts": 4, "num_experts_per_tok": 2, "moe_layers": [0, 2]},
            **{"no_rope_layers": [1, 1, 0], "attention_chunk_size": 5, "floor_scale": 4, "attn_scale": 0.5},
            "rope_parameters": {
                **{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0},
                **{"high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            },
        },
    ),
    "llama4_no_qk_norm": (
        "Llama4Text",
        {
            **{"intermediate_size": 32, "intermediate_size_mlp": 48, "num_local_experts": 4},
            **{"num_experts_per_tok": 1, "use_qk_norm": False, "attn_temperature_tuning": False},
            **{"no_rope_layers": [1, 0, 1], "attention_chunk_size": 4, "attention_bias": True},
        },
    ),
    "phimoe": (
        "Phimoe",
        {
            **{"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
            **{"attention_bias": True, "lm_head_bias": True, "router_jitter_noise": 0.2},
        },
    ),
    # longrope as Phi-3.5-MoE ships it; prompts already past the original context (long_mscale)
    "phimoe_longrope": (
        "Phimoe",
        {
            **{"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
            "rope_parameters": {
                **{"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4},
                **{"short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "short_mscale": 1.1},
                **{"long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "long_mscale": 1.25},
            },
        },
    ),
    "granitemoe": (
        "GraniteMoe",
        {
            **{"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
            **{"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.2},
            "logits_scaling": 6.0,
        },
    ),
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        {
            **{"intermediate_size": 48, "moe_intermediate_size": 32, "moe_num_experts": 6, "moe_k": 2},
            **{"moe_num_shared_experts": 1, "moe_layer_start_index": 1},
        },
    ),
    # MLA: every head has its own keys (num_key_value_heads = heads); 8 experts in 4 groups, 2 kept
    "deepseek_v3": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": 24, "n_group": 4, "topk_group": 2}),
    "deepseek_v3_yarn": (
        "DeepseekV3",
        {
            **DEEPSEEK,
            **{"rope_interleave": False, "n_group": 2, "topk_group": 1, "max_position_embeddings": 256},
            "rope_parameters": {
                **{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.7},
                **{"mscale_all_dim": 0.9, "original_max_position_embeddings": 64},
            },
        },
    ),
    "deepseek_v2": (
        "DeepseekV2",
        {**DEEPSEEK, "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    ),
    "deepseek_v2_lite": ("DeepseekV2", {**DEEPSEEK, "q_lora_rank": None, "topk_method": "greedy"}),
    "glm4_moe": (
        "Glm4Moe",
        {
            **{"intermediate_size": 80, "moe_intermediate_size": 32, "n_routed_experts": 8, "head_dim": 16},
            **{"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1},
            **{"attention_bias": True, "use_qk_norm": True, "routed_scaling_factor": 2.5},
        },
    ),
}


CAUSAL_LM = {"Llama4Text": "Llama4"}  # config prefix -> model prefix, where they differ


def hf_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    import transformers

    prefix, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{CAUSAL_LM.get(prefix, prefix)}ForCausalLM")(config).eval().to(dtype)
    _randomize_zero_inits(model)
    return model


def _randomize_zero_inits(model: torch.nn.Module) -> None:
    """Some families initialise routers, sinks or biases to zero or one; make every weight
    count so the comparison exercises it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif param.abs().max() == 0:
                param.normal_(0, 0.2)
            elif "router" in name or ".gate." in name:
                param.normal_(0, 0.3)


def save_hf(model, folder: Path, shard_size: str | None = None) -> Path:
    """save_pretrained: original per-expert layout (optionally sharded with an index)."""
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def save_fused(model, folder: Path) -> Path:
    """The stacked-expert layout transformers 5 keeps in memory, written as is."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    (folder / "config.json").write_text(json.dumps(config, default=str))
    return folder
