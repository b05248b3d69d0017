"""ModelSpec: the shape and numerics of a decoder-only MoE transformer, with no tensors.

A spec is what every part of flowmoe agrees on: the kernels read its numerics
(router kind, activation, norms), the loader reads its shapes to validate a
checkpoint, the schedulers and the cost model read its sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from attrs import evolve, field, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.jsonfile import read_json_object

QKNorm = Literal["none", "head", "full"]
RouterKind = Literal["softmax_topk", "topk_softmax"]
Activation = Literal["silu", "clamped_swiglu"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@frozen
class RopeSpec:
    """Rotary embedding: base frequency and the scaling variant (default, linear, yarn)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@frozen
class AttentionSpec:
    """Grouped-query attention with the per-family extras."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None
    sinks: bool = False
    windows: tuple[int | None, ...] = ()  # sliding window per layer, None = full causal

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


@frozen
class MoESpec:
    """Router, routed experts, shared experts and which layers are sparse at all."""

    experts: int
    top_k: int
    intermediate: int
    router: RouterKind = "softmax_topk"
    norm_topk: bool = True
    combine_fp32: bool = False  # combine weights stay float32 (Mixtral), else the model's dtype
    router_bias: bool = False
    expert_bias: bool = False
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    dense_intermediate: int = 0

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0


@frozen
class ModelSpec:
    """A decoder-only MoE model: sizes, numerics and token ids."""

    name: str
    family: str
    vocab: int
    hidden: int
    layers: int
    attention: AttentionSpec
    rope: RopeSpec
    moe: MoESpec
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = field(default="float32")
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_positions: int = 4096

    @dtype.validator
    def _check_dtype(self, _attr: object, value: str) -> None:
        if value not in DTYPE_BYTES:
            raise ConfigError(f"unsupported dtype {value!r}; use one of {', '.join(DTYPE_BYTES)}")

    # ---- sizes (parameters and bytes) used by memory accounting and the cost model

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def expert_params(self) -> int:
        params = 3 * self.hidden * self.moe.intermediate
        if self.moe.expert_bias:
            params += 2 * self.moe.intermediate + self.hidden
        return params

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.dtype_bytes

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden * self.moe.shared_intermediate + (self.hidden if self.moe.shared_gate else 0)

    @property
    def attention_params(self) -> int:
        a = self.attention
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        params = self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.hidden  # qkv, o, two norms
        if a.qkv_bias:
            params += q + 2 * kv
        if a.o_bias:
            params += self.hidden
        return params

    @property
    def router_params(self) -> int:
        return self.moe.experts * self.hidden + (self.moe.experts if self.moe.router_bias else 0)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.moe.dense_layers

    def layer_dense_bytes(self, layer: int) -> int:
        """Bytes of a layer's always-used weights: attention, router, shared or dense MLP."""
        params = self.attention_params
        if self.is_moe_layer(layer):
            params += self.router_params + self.shared_params
        else:
            params += 3 * self.hidden * self.moe.dense_intermediate
        return params * self.dtype_bytes

    def layer_expert_bytes(self, layer: int) -> int:
        return self.moe.experts * self.expert_bytes if self.is_moe_layer(layer) else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token holds across all layers."""
        a = self.attention
        return 2 * a.kv_heads * a.head_dim * self.layers * self.dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        copies = 1 if self.tie_embeddings else 2
        return (copies * self.vocab * self.hidden + self.hidden) * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        layers = sum(self.layer_dense_bytes(i) + self.layer_expert_bytes(i) for i in range(self.layers))
        return layers + self.embedding_bytes

    def with_layers(self, layers: int) -> ModelSpec:
        """The same model cut (or extended) to `layers` layers, per-layer tables adjusted."""
        a = self.attention
        windows = tuple(a.windows[i % len(a.windows)] for i in range(layers)) if a.windows else ()
        dense = tuple(i for i in self.moe.dense_layers if i < layers)
        return evolve(
            self,
            layers=layers,
            attention=evolve(a, windows=windows),
            moe=evolve(self.moe, dense_layers=dense),
        )

    def with_dtype(self, dtype: str) -> ModelSpec:
        return evolve(self, dtype=dtype)

    # ---- construction

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelSpec:
        """Read a Hugging Face `config.json` (a path to it, its folder, or the parsed dict)."""
        from flowmoe.core.families import family_for_config
        from flowmoe.core.families.config_fields import check_config

        if isinstance(source, dict):
            config, where = source, "config"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            config, where = read_json_object(path), str(path)
        family = family_for_config(config, where)
        check_config(config, where)
        try:
            return family.parse(config, name=_model_name(source))
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc.args[0]!r} for family {family.name}") from exc


def _model_name(source: str | Path | dict[str, Any]) -> str:
    if isinstance(source, dict):
        return str(source.get("_name_or_path") or source.get("model_type") or "model")
    path = Path(source)
    return path.name if path.is_dir() else path.parent.name
