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
}


def hf_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    import transformers

    prefix, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval().to(dtype)
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
