"""Llama 4 text (Scout, Maverick): top-k router logits through a sigmoid scaling each expert's input,
an always-on shared expert, MoE layers every `interleave_moe_layer_step` layers (dense MLPs of
`intermediate_size_mlp` between), NoPE layers every `no_rope_layer_interval` layers with a
position-dependent query temperature, chunked attention on the RoPE layers, a weightless QK-norm,
RoPE on interleaved pairs with llama3 frequency scaling."""

from __future__ import annotations

from typing import Any

from flowmoe.core.errors import ConfigError
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


def moe_layers(config: dict[str, Any]) -> tuple[int, ...]:
    layers = int(config["num_hidden_layers"])
    if config.get("moe_layers") is not None:
        return tuple(sorted(set(int(i) for i in config["moe_layers"])))
    step = int(config.get("interleave_moe_layer_step", 1) or 1)
    return tuple(range(step - 1, layers, step))


def nope_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """Layers without RoPE: `no_rope_layers` holds 1 where a layer uses RoPE (an empty list: the
    default interval)."""
    layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if not flags:
        interval = int(config.get("no_rope_layer_interval", 4) or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ConfigError(f'"no_rope_layers" must hold one flag per layer ({layers}), got {len(flags)}')
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _chunks(config: dict[str, Any], nope: tuple[int, ...]) -> tuple[int | None, ...]:
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [
        "full_attention" if i in nope else "chunked_attention" for i in range(layers)
    ]
    if "sliding_attention" in types:
        raise ConfigError('"layer_types": sliding_attention is not a Llama 4 layer type')
    size = config.get("attention_chunk_size", 8192)
    if size is None:
        return ()
    return tuple(int(size) if t == "chunked_attention" else None for t in types)


def parse(config: dict[str, Any], name: str) -> ModelSpec:
    layers = int(config["num_hidden_layers"])
    sparse = moe_layers(config)
    bad = [i for i in sparse if i >= layers]
    if bad:
        raise ConfigError(f'"moe_layers" must hold layer numbers from 0 to {layers - 1}, got {bad[0]}')
    require_silu(config, "Llama 4")
    nope = nope_layers(config)
    bias = bool(config.get("attention_bias", False))
    tuning = bool(config.get("attn_temperature_tuning", True))
    temperature = (float(config.get("attn_scale", 0.1)), float(config.get("floor_scale", 8192)))
    inter = int(config["intermediate_size"])
    return ModelSpec(
        **common_fields(config, name, "llama4_text"),
        attention=AttentionSpec(
            **attention_shape(config),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="l2" if config.get("use_qk_norm", True) else "none",
            chunks=_chunks(config, nope),
            nope_layers=nope,
            temperature=temperature if tuning else None,
        ),
        rope=rope_from_config(config, default_theta=500000.0),
        moe=MoESpec(
            experts=num_experts(config),
            top_k=int(config["num_experts_per_tok"]),
            intermediate=inter,
            router="topk_sigmoid",
            norm_topk=False,
            scale_input=True,
            shared_intermediate=inter,
            dense_layers=tuple(i for i in range(layers) if i not in sparse),
            dense_intermediate=int(config.get("intermediate_size_mlp", 16384)),
        ),
    )


FAMILY = Family(
    name="llama4_text",
    architectures=("Llama4ForCausalLM",),
    model_types=("llama4_text",),
    parse=parse,
    names=TensorNames(
        moe_prefixes=("feed_forward",),
        router="router",
        fused_gate_up="columns",
        dense_mlp="feed_forward",
        rope_pairs=True,
    ),
)
