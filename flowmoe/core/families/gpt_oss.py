"""GPT-OSS (OpenAI): router with bias taking top-k logits then softmax, clamped SwiGLU experts with
biases and interleaved gate/up columns, attention sinks, alternating sliding-window layers, YaRN RoPE."""

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
    layers = int(config["num_hidden_layers"])
    config = {"sliding_window": 128, **config}
    if not config.get("layer_types"):
        config["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
    bias = bool(config.get("attention_bias", True))
    return ModelSpec(
        **common_fields(config, name, "gpt_oss"),
        attention=AttentionSpec(
            **attention_shape(config),
            qkv_bias=bias,
            o_bias=bias,
            sinks=True,
            windows=layer_windows(config),
        ),
        rope=rope_from_config(config, default_theta=150000.0),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=int(config["intermediate_size"]),
            router="topk_softmax",
            norm_topk=False,
            router_bias=True,
            expert_bias=True,
            activation="clamped_swiglu",
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        ),
    )


FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    parse=parse,
    names=TensorNames(router="router", fused_gate_up="interleaved_columns"),
)
