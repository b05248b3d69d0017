"""Phi-3.5-MoE: Mixtral's layout with LayerNorms (weight and bias), biases on attention and the lm
head where configured, and the sparsemixer router at inference: top-2 only, each expert's weight a
softmax over the experts whose logit is within a relative 2 * router_jitter_noise of its own."""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.families.base import (
    Family,
    TensorNames,
    attention_shape,
    common_fields,
    layer_windows,
    num_experts,
    require_silu,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    top_k = int(config["num_experts_per_tok"])
    if top_k != 2:
        raise ConfigError(f'"num_experts_per_tok" must be 2 for Phi-3.5-MoE (its sparsemixer), got {top_k}')
    require_silu(config, "Phi-3.5-MoE")
    bias = bool(config.get("attention_bias", False))
    shape = attention_shape(config)
    rope = rope_from_config(config, default_theta=1e6)
    if rope.kind == "longrope" and len(rope.short_factor) != shape["head_dim"] // 2:
        half = shape["head_dim"] // 2
        raise ConfigError(f'"rope_scaling.short_factor" must hold head_dim / 2 = {half} factors')
    return ModelSpec(
        **{**common_fields(config, name, "phimoe"), "norm_eps": float(config.get("rms_norm_eps", 1e-5))},
        norm="layer",
        lm_head_bias=bool(config.get("lm_head_bias", False)),
        attention=AttentionSpec(**shape, qkv_bias=bias, o_bias=bias, windows=layer_windows(config)),
        rope=rope,
        moe=MoESpec(
            experts=num_experts(config),
            top_k=top_k,
            intermediate=int(config["intermediate_size"]),
            router="sparsemixer",
            norm_topk=False,
            jitter_eps=float(config.get("router_jitter_noise", 0.01)),
        ),
    )


FAMILY = Family(
    name="phimoe",
    architectures=("PhimoeForCausalLM",),
    model_types=("phimoe",),
    parse=parse,
    names=TensorNames(moe_prefixes=("block_sparse_moe",), expert_proj=("w1", "w3", "w2")),
)
