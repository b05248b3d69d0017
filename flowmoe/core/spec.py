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
from flowmoe.core.hf_cache import repo_id_of
from flowmoe.core.jsonfile import read_json_object

QKNorm = Literal["none", "head", "full", "l2"]  # l2: weightless, rope layers only (Llama 4)
RouterKind = Literal[
    "softmax_topk",
    "topk_softmax",
    "topk_sigmoid",
    "sparsemixer",
    "softmax_biased_topk",
    "sigmoid_group",
    "softmax_group",
]
Activation = Literal["silu", "clamped_swiglu"]
NormKind = Literal["rms", "layer"]  # layer: LayerNorm, its weight and bias stacked as [2, dim]

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
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    short_factor: tuple[float, ...] = ()  # longrope (Phi-3.5): a divisor per frequency
    short_mscale: float = 1.0  # longrope: cos/sin scale at positions within original_max_positions
    long_mscale: float = 1.0  # longrope: cos/sin scale at positions beyond


@frozen
class MLASpec:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank q LoRA; keys and
    values from one compressed latent per token (kv_lora_rank) plus one decoupled RoPE key shared by
    every head (qk_rope_head_dim). The KV cache holds the latent and the RoPE key, nothing per head."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: one q projection, no LoRA
    rope_interleave: bool = True  # RoPE dimensions stored as (x0, x1), (x2, x3), ... pairs
    softmax_scale: float = 0.0  # 0: qk_head_dim ** -0.5 (YaRN multiplies in mscale**2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements one token holds in one layer's cache: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int) -> int:
        """Attention projections and the LoRA norms, without the layer's two norms."""
        q = heads * self.qk_head_dim
        lora = self.q_lora_rank
        q_params = hidden * lora + lora * (q + 1) if lora else hidden * q  # q_a, its norm, q_b; or q_proj
        up = self.kv_lora_rank * (1 + heads * (self.qk_nope_head_dim + self.v_head_dim))  # norm, kv_b
        return q_params + hidden * self.cache_dim + up + heads * self.v_head_dim * hidden  # + kv_a, o


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
    mla: MLASpec | None = None  # multi-head latent attention (DeepSeek-V2/V3) instead of GQA
    rotary_dim: int = 0  # RoPE on the first rotary_dim dimensions of each head (0: all of them)
    chunks: tuple[int | None, ...] = ()  # chunked attention per layer (Llama 4), None = not chunked
    nope_layers: tuple[int, ...] = ()  # layers without rotary embedding (Llama 4)
    temperature: tuple[float, float] | None = None  # NoPE layers' query scale (attn_scale, floor_scale)
    scale: float | None = None  # softmax scale when not head_dim ** -0.5 (Granite's attention_multiplier)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    # ---- widths per token the cost model prices (multi-head latent attention differs from GQA)

    @property
    def q_width(self) -> int:
        """Query elements per token."""
        return self.heads * (self.mla.qk_head_dim if self.mla else self.head_dim)

    @property
    def kv_width(self) -> int:
        """Half the elements one token caches per layer: its K (or V); MLA: half its latent + RoPE key."""
        return self.mla.cache_dim // 2 if self.mla else self.kv_heads * self.head_dim

    @property
    def out_width(self) -> int:
        """Attention output elements per token (the O projection's input)."""
        return self.heads * (self.mla.v_head_dim if self.mla else self.head_dim)

    def pre_params(self, hidden: int) -> int:
        """Weights the pre-attention step reads: q/k/v projections, or MLA's down- and q up-projections."""
        m = self.mla
        if m is None:
            return hidden * (self.q_width + 2 * self.kv_width)
        q_up = m.q_lora_rank * self.q_width if m.q_lora_rank else 0
        return hidden * ((m.q_lora_rank or self.q_width) + m.cache_dim) + q_up

    def pair_flops(self) -> int:
        """Flops per (query, cached key) pair: scores and weighted values over all heads; MLA attends
        over the latent + RoPE key and sums latents (the up-projection absorbed)."""
        m = self.mla
        return 4 * self.q_width if m is None else 2 * self.heads * (m.cache_dim + m.kv_lora_rank)

    def chunk(self, layer: int) -> int | None:
        return self.chunks[layer] if self.chunks else None

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers


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
    scale_input: bool = False  # the combine weight scales the expert's input, not its output (Llama 4)
    jitter_eps: float = 0.01  # sparsemixer's relative threshold (Phi-3.5-MoE's router_jitter_noise)
    norm_min: float = 1e-12  # softmax_biased_topk's floor under the renormalising sum (ERNIE 4.5)
    selection_bias: bool = False  # a per-expert bias added to the scores for selection only
    n_group: int = 1  # group-limited routers (DeepSeek): experts in n_group groups, topk_group chosen
    topk_group: int = 1
    routed_scaling: float = 1.0  # combine weights multiplied by this (DeepSeek's routed_scaling_factor)

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
    norm: NormKind = "rms"
    lm_head_bias: bool = False
    embedding_multiplier: float = 1.0  # Granite
    residual_multiplier: float = 1.0  # Granite: scales each block's output before the residual add
    logits_divisor: float = 1.0  # Granite's logits_scaling

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
        if a.mla is not None:
            return a.mla.params(self.hidden, a.heads) + 2 * self.hidden
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        params = self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.hidden  # qkv, o, two norms
        if self.norm == "layer":
            params += 2 * self.hidden  # the norms' biases
        if a.qkv_bias:
            params += q + 2 * kv
        if a.o_bias:
            params += self.hidden
        if a.qk_norm in ("head", "full"):  # q/k RMSNorm weights: per head, or over the projections
            params += 2 * a.head_dim if a.qk_norm == "head" else q + kv
        if a.sinks:  # one attention-sink logit per head
            params += a.heads
        return params

    @property
    def router_params(self) -> int:
        biases = int(self.moe.router_bias) + int(self.moe.selection_bias)
        return self.moe.experts * self.hidden + biases * self.moe.experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.moe.dense_layers

    def pregate_source(self, layer: int) -> int:
        """The layer whose post-attention state a pre-gate reads to predict MoE layer `layer`'s
        experts: the MoE layer before it (Pre-gated MoE: block N's pre-gate selects block N + 1's
        experts), else the layer just before it."""
        before = [m for m in range(layer) if self.is_moe_layer(m)]
        return before[-1] if before else layer - 1

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
        if a.mla is not None:
            return a.mla.cache_dim * self.layers * self.dtype_bytes
        return 2 * a.kv_heads * a.head_dim * self.layers * self.dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        copies = 1 if self.tie_embeddings else 2
        norm = self.hidden * (2 if self.norm == "layer" else 1)
        head_bias = self.vocab if self.lm_head_bias else 0
        return (copies * self.vocab * self.hidden + norm + head_bias) * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        layers = sum(self.layer_dense_bytes(i) + self.layer_expert_bytes(i) for i in range(self.layers))
        return layers + self.embedding_bytes

    def with_layers(self, layers: int) -> ModelSpec:
        """The same model cut (or extended) to `layers` layers, per-layer tables adjusted."""
        a = self.attention
        windows = tuple(a.windows[i % len(a.windows)] for i in range(layers)) if a.windows else ()
        chunks = tuple(a.chunks[i % len(a.chunks)] for i in range(layers)) if a.chunks else ()
        dense = tuple(i for i in self.moe.dense_layers if i < layers)
        nope = tuple(i for i in a.nope_layers if i < layers)
        return evolve(
            self,
            layers=layers,
            attention=evolve(a, windows=windows, chunks=chunks, nope_layers=nope),
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
        check_config(config, where)
        family = family_for_config(config, where)
        try:
            spec = family.parse(config, name=_model_name(source))
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc.args[0]!r} for family {family.name}") from exc
        return spec if isinstance(source, dict) else _with_generation_eos(spec, Path(where).parent)


def _with_generation_eos(spec: ModelSpec, folder: Path) -> ModelSpec:
    """The eos ids of generation_config.json beside config.json added to config.json's (any of them
    ends a sequence); ids outside the vocabulary dropped, as config.json's are."""
    from flowmoe.core.generation_config import read_generation_config

    generation = read_generation_config(folder)
    extra = [e for e in generation.eos_token_ids if e < spec.vocab] if generation else []
    new = tuple(e for e in dict.fromkeys(extra) if e not in spec.eos_token_ids)
    return evolve(spec, eos_token_ids=spec.eos_token_ids + new) if new else spec


def _model_name(source: str | Path | dict[str, Any]) -> str:
    if isinstance(source, dict):
        return str(source.get("_name_or_path") or source.get("model_type") or "model")
    folder = Path(source) if Path(source).is_dir() else Path(source).parent
    repo = repo_id_of(folder)  # a Hugging Face cache snapshot's name, not its commit
    return repo.split("/")[-1] if repo else folder.name
