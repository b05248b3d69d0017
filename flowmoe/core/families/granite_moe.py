"""Granite MoE (IBM Granite 3.x MoE): Mixtral-like experts stored fused ([E, 2I, H] `input_linear`,
[E, H, I] `output_linear`), a top-k-then-softmax router, and four multipliers: on the embedding, on
each block's output before the residual add, as the attention softmax scale, and dividing the logits."""

from __future__ import annotations

from typing import Any

from flowmoe.core.families.base import (
    Family,
    TensorNames,
    attention_shape,
    common_fields,
    num_experts,
    require_silu,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    require_silu(config, "Granite MoE")
    bias = bool(config.get("attention_bias", False))
    return ModelSpec(
        **common_fields(config, name, "granitemoe"),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_divisor=float(config.get("logits_scaling", 1.0)),
        attention=AttentionSpec(
            **attention_shape(config),
            qkv_bias=bias,
            o_bias=bias,
            scale=float(config.get("attention_multiplier", 1.0)),
        ),
        rope=rope_from_config(config, default_theta=10000.0),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=int(config["intermediate_size"]),
            router="topk_softmax",
            norm_topk=False,
        ),
    )


FAMILY = Family(
    name="granitemoe",
    architectures=("GraniteMoeForCausalLM",),
    model_types=("granitemoe",),
    parse=parse,
    names=TensorNames(
        moe_prefixes=("block_sparse_moe",),
        router="router.layer",
        fused=("input_linear.weight", "output_linear.weight"),
    ),
)
