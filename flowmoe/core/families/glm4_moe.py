"""GLM-4.5 MoE (`Glm4MoeForCausalLM`): DeepSeek-V3's router (sigmoid scores, a selection-only bias,
group-limited top-k, `routed_scaling_factor`) and shared experts, the first `first_k_dense_replace`
layers dense, with grouped-query attention: q/k/v biases (`attention_bias`), optional per-head
RMSNorm on q and k (`use_qk_norm`), RoPE on the first `partial_rotary_factor` of each head only."""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.families.base import (
    Family,
    TensorNames,
    attention_shape,
    common_fields,
    num_experts,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def _rotary_dim(config: dict[str, Any], head_dim: int) -> int:
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5)))
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ConfigError(
            f'config: "partial_rotary_factor" ({factor}) must give an even rotary dimension ≥ 2 '
            f"of the {head_dim}-wide heads"
        )
    return dim


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    shape = attention_shape(config)
    experts, groups = num_experts(config), int(config.get("n_group") or 1)
    if experts % groups or experts // groups < 2:
        raise ConfigError(
            f'config: "n_group" ({groups}) must split the {experts} routed experts in groups of at least 2'
        )
    top_group = int(config.get("topk_group") or 1)
    if top_group > groups:
        raise ConfigError(f'config: "topk_group" must be from 1 to "n_group" ({groups}), got {top_group}')
    inter = int(config["moe_intermediate_size"])
    dense = min(int(config.get("first_k_dense_replace", 1) or 0), int(config["num_hidden_layers"]))
    return ModelSpec(
        **common_fields(config, name, "glm4_moe"),
        attention=AttentionSpec(
            **shape,
            qkv_bias=bool(config.get("attention_bias", False)),
            qk_norm="head" if config.get("use_qk_norm") else "none",
            rotary_dim=_rotary_dim(config, shape["head_dim"]),
        ),
        rope=rope_from_config(config, default_theta=10000.0),
        moe=MoESpec(
            experts=experts,
            top_k=int(config["num_experts_per_tok"]),
            intermediate=inter,
            router="sigmoid_group",
            norm_topk=bool(config.get("norm_topk_prob", True)),
            combine_fp32=True,
            selection_bias=True,
            n_group=groups,
            topk_group=top_group,
            routed_scaling=float(config.get("routed_scaling_factor") or 1.0),
            shared_intermediate=inter * int(config.get("n_shared_experts", 1) or 0),
            dense_layers=tuple(range(dense)),
            dense_intermediate=int(config.get("intermediate_size", 0)),
        ),
    )


FAMILY = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    parse=parse,
    names=TensorNames(
        shared_expert="shared_experts",
        selection_bias="gate.e_score_correction_bias",
        selection_bias_rows=False,
    ),
)
