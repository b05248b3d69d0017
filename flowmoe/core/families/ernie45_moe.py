"""ERNIE 4.5 MoE (Baidu): a float32 softmax router whose top-k is chosen on softmax + a per-expert
selection bias (`moe_statics.e_score_correction_bias`) and weighted by the renormalised softmax,
shared experts of moe_num_shared_experts × moe_intermediate_size, MoE layers from
`moe_layer_start_index` to `moe_layer_end_index` every `moe_layer_interval` (dense MLPs elsewhere),
RoPE on interleaved pairs, tied embeddings by default."""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
from flowmoe.core.families.base import (
    Family,
    TensorNames,
    attention_shape,
    common_fields,
    require_silu,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def moe_layers(config: dict[str, Any]) -> tuple[int, ...]:
    layers = int(config["num_hidden_layers"])
    start = int(config.get("moe_layer_start_index", 1))
    end = int(config.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    interval = int(config.get("moe_layer_interval", 1) or 1)
    return tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    if config.get("use_bias", False):
        raise ConfigError('"use_bias": true is not supported for ERNIE 4.5 MoE (released models: false)')
    require_silu(config, "ERNIE 4.5 MoE")
    layers = int(config["num_hidden_layers"])
    sparse = moe_layers(config)
    inter = int(config["moe_intermediate_size"])
    experts = int(config.get("moe_num_experts", config.get("num_experts", 64)))
    top_k = int(config.get("moe_k", config.get("num_experts_per_tok", 6)))
    if top_k > experts:
        raise ConfigError(f'"moe_k" must be an integer from 1 to the {experts} experts, got {top_k}')
    return ModelSpec(
        **{
            **common_fields(config, name, "ernie4_5_moe"),
            "norm_eps": float(config.get("rms_norm_eps", 1e-5)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        },
        attention=AttentionSpec(**attention_shape(config)),
        rope=rope_from_config(config, default_theta=500000.0),
        moe=MoESpec(
            experts=experts,
            top_k=top_k,
            intermediate=inter,
            router="softmax_biased_topk",
            norm_min=float(config.get("moe_norm_min", 1e-12)),
            selection_bias=True,
            shared_intermediate=inter * int(config.get("moe_num_shared_experts", 2)),
            dense_layers=tuple(i for i in range(layers) if i not in sparse),
            dense_intermediate=int(config["intermediate_size"]),
        ),
    )


FAMILY = Family(
    name="ernie4_5_moe",
    architectures=("Ernie4_5_MoeForCausalLM",),
    model_types=("ernie4_5_moe",),
    parse=parse,
    names=TensorNames(
        shared_expert="shared_experts",
        selection_bias="moe_statics.e_score_correction_bias",
        rope_pairs=True,
    ),
)
