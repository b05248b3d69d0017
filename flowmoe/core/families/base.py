"""What a model family contributes: how its config.json reads and how its tensors are named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypedDict

from attrs import frozen

from flowmoe.core.spec import ModelSpec, RopeSpec

FusedGateUp = Literal["rows", "interleaved_columns", "columns"]


@frozen
class TensorNames:
    """Checkpoint tensor names of one family, relative to `model.layers.{l}.`.

    Per-expert layout: `{moe}.experts.{e}.{gate|up|down}.weight`.
    Fused layout: `{moe}.experts.gate_up_proj` and `{moe}.experts.down_proj`, either
    `rows` ([E, 2I, H] gate rows then up rows; down [E, H, I]) or
    `interleaved_columns` ([E, H, 2I] gate and up columns interleaved; down [E, I, H]) or
    `columns` ([E, H, 2I] gate columns then up columns; down [E, I, H]).
    """

    moe_prefixes: tuple[str, ...] = ("mlp",)
    router: str = "gate"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_gate_up: FusedGateUp = "rows"
    shared_expert: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"
    dense_mlp: str = "mlp"  # a dense layer's MLP
    fused: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")  # fused gate_up, down
    selection_bias: str = ""  # the router's selection-only bias, relative to the MoE prefix
    selection_bias_rows: bool = True  # stored [1, E] (ERNIE), else [E] (DeepSeek, GLM)
    rope_pairs: bool = False  # q/k rotate (x0, x1), (x2, x3) pairs: rows reordered to halves on load


@frozen
class Family:
    """A supported architecture: its names in config.json and how to read it."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: Callable[..., ModelSpec]
    names: TensorNames = TensorNames()


def rope_from_config(config: dict[str, Any], default_theta: float) -> RopeSpec:
    """RoPE from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "yarn", "llama3", "longrope"):
        from flowmoe.core.errors import ConfigError

        supported = "default, linear, yarn, llama3, longrope"
        raise ConfigError(f"rope type {kind!r} is not supported (supported: {supported})")
    return RopeSpec(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0) or 1.0),
        original_max_positions=int(params.get("original_max_position_embeddings", 0) or 0),
        beta_fast=float(params.get("beta_fast", 32.0) or 32.0),
        beta_slow=float(params.get("beta_slow", 1.0) or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0) or 1.0),
        high_freq_factor=float(params.get("high_freq_factor", 4.0) or 4.0),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        short_mscale=float(params.get("short_mscale", 1.0) or 1.0),
        long_mscale=float(params.get("long_mscale", 1.0) or 1.0),
    )


def token_ids(config: dict[str, Any]) -> dict[str, Any]:
    """bos and eos ids, eos normalised to a tuple; ids outside the vocabulary are dropped."""
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
    bos = config.get("bos_token_id")
    return {
        "bos_token_id": bos if isinstance(bos, int) and 0 <= bos < vocab else None,
        "eos_token_ids": tuple(int(e) for e in eos_list if 0 <= int(e) < vocab),
    }


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts; families and transformers versions name the field differently."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key) is not None:
            return int(config[key])
    raise KeyError("num_local_experts")


def dtype_of(config: dict[str, Any]) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


class AttentionShape(TypedDict):
    """AttentionSpec's shape fields, passed on as keywords."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config: dict[str, Any]) -> AttentionShape:
    """heads, kv_heads (default: heads) and head_dim, which every family reads alike."""
    heads = int(config["num_attention_heads"])
    return {
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": head_dim_of(config),
    }


def head_dim_of(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def common_fields(config: dict[str, Any], name: str, family: str) -> dict[str, Any]:
    """The ModelSpec fields every family reads the same way."""
    return {
        "name": name,
        "family": family,
        "vocab": int(config["vocab_size"]),
        "hidden": int(config["hidden_size"]),
        "layers": int(config["num_hidden_layers"]),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "dtype": dtype_of(config),
        "max_positions": int(config.get("max_position_embeddings", 4096)),
        **token_ids(config),
    }


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Sliding window per layer from `layer_types` (or one window for all layers)."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window and config.get("use_sliding_window", True):
        return (int(window),) * layers
    return ()


def require_silu(config: dict[str, Any], family: str) -> None:
    """The SwiGLU experts flowmoe runs use SiLU; another `hidden_act` fails naming the field."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        from flowmoe.core.errors import ConfigError

        raise ConfigError(f'"hidden_act" {act!r} is not supported for {family} (only silu)')
