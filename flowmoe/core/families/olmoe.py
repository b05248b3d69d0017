"""OLMoE (AllenAI): RMSNorm over the whole q and k projections, optional qkv clipping,
softmax router without top-k renormalisation by default."""

from __future__ import annotations

from typing import Any

from flowmoe.core.families.base import Family, attention_shape, common_fields, num_experts, rope_from_config
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    clip = config.get("clip_qkv")
    return ModelSpec(
        **common_fields(config, name, "olmoe"),
        attention=AttentionSpec(
            **attention_shape(config),
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            qk_norm="full",
            clip_qkv=float(clip) if clip is not None else None,
        ),
        rope=rope_from_config(config, default_theta=1e4),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=int(config["intermediate_size"]),
            router="softmax_topk",
            norm_topk=bool(config.get("norm_topk_prob", False)),
        ),
    )


FAMILY = Family(name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",), parse=parse)
