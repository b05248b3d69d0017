"""Qwen2-MoE and Qwen3-MoE: softmax router (top-k renormalised when `norm_topk_prob`).

Qwen2-MoE adds a shared expert behind a sigmoid gate and biases on q/k/v;
Qwen3-MoE adds per-head RMSNorm on q and k. Both may keep dense MLP layers
(`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

from typing import Any

from flowmoe.core.families.base import (
    Family,
    attention_shape,
    common_fields,
    layer_windows,
    num_experts,
    rope_from_config,
)
from flowmoe.core.spec import AttentionSpec, ModelSpec, MoESpec


def _dense_layers(config: dict[str, Any]) -> tuple[int, ...]:
    only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    experts = num_experts(config)
    return tuple(
        i for i in range(int(config["num_hidden_layers"])) if i in only or experts == 0 or (i + 1) % step != 0
    )


def _parse(config: dict[str, Any], name: str, family: str) -> ModelSpec:
    qwen2 = family == "qwen2_moe"
    bias = bool(config.get("qkv_bias", True)) if qwen2 else bool(config.get("attention_bias", False))
    return ModelSpec(
        **common_fields(config, name, family),
        attention=AttentionSpec(
            **attention_shape(config),
            qkv_bias=bias,
            o_bias=False if qwen2 else bias,
            qk_norm="none" if qwen2 else "head",
            windows=layer_windows(config),
        ),
        rope=rope_from_config(config, default_theta=1e6 if not qwen2 else 1e4),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=int(config["moe_intermediate_size"]),
            router="softmax_topk",
            norm_topk=bool(config.get("norm_topk_prob", not qwen2)),
            shared_intermediate=int(config.get("shared_expert_intermediate_size", 0)) if qwen2 else 0,
            shared_gate=qwen2,
            dense_layers=_dense_layers(config),
            dense_intermediate=int(config.get("intermediate_size", 0)),
        ),
    )


def parse_qwen2(config: dict[str, Any], name: str) -> ModelSpec:
    return _parse(config, name, "qwen2_moe")


def parse_qwen3(config: dict[str, Any], name: str) -> ModelSpec:
    return _parse(config, name, "qwen3_moe")


QWEN2 = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    parse=parse_qwen2,
)
QWEN3 = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    parse=parse_qwen3,
)
