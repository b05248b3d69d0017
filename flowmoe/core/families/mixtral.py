"""Mixtral (Mistral AI): softmax router, top-k renormalised, SwiGLU experts `w1`/`w3`/`w2`."""

from __future__ import annotations

from typing import Any

from flowmoe.core.families.base import (
    Family,
    TensorNames,
    attention_shape,
    common_fields,
    layer_windows,
    num_experts,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    return ModelSpec(
        **common_fields(config, name, "mixtral"),
        attention=AttentionSpec(
            **attention_shape(config),
            windows=layer_windows(config),
        ),
        rope=rope_from_config(config, default_theta=1e6),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=int(config["intermediate_size"]),
            router="softmax_topk",
            norm_topk=True,
            combine_fp32=True,
        ),
    )


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    parse=parse,
    names=TensorNames(moe_prefixes=("block_sparse_moe", "mlp"), expert_proj=("w1", "w3", "w2")),
)
