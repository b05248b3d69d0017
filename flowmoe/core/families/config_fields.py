"""The config.json fields the families read, with their types and ranges, checked before parsing.

One table says what each field may hold; a bad value fails with one line naming
the field and what is allowed, instead of a ZeroDivisionError or a model that
runs zero layers. A field absent (or null) keeps its family default; required
fields are the family parser's concern.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from attrs import frozen

from flowmoe.core.errors import ConfigError

Kind = Literal["int", "number", "bool", "str"]
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
MAX_LAYERS = 4096  # per-layer tables are built eagerly; Qwen3-235B-A22B's config.json has 94
# Every size a config gives is bounded before anything is built from it (tables per expert, per
# layer or per position), far beyond every published model (Kimi K2: 384 experts, 7168 hidden,
# 163840 vocab) yet below what a host could hold; whether the weights fit is judged against the
# checkpoint's shards (model/checkpoint.py) and the KV cache against the host's memory (jobs).
MAX_WIDTH = 2**20  # hidden, intermediate and head sizes
MAX_HEADS = 2**12
MAX_EXPERTS = 2**16
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**32  # positions (max_position_embeddings, windows, chunks)


@frozen
class Field:
    """What one field may hold: a kind, bounds (inclusive `at_least`, exclusive `above`), choices."""

    kind: Kind
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    choices: tuple[str, ...] = ()
    many: bool = False  # a list of such values (or one value, when `one_or_many`)
    one_or_many: bool = False

    def ok(self, value: Any) -> bool:
        if self.many and isinstance(value, list):
            return all(self._ok_one(v) for v in value)
        return (not self.many or self.one_or_many) and self._ok_one(value)

    def _ok_one(self, value: Any) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an integer past float's range (10**400): no field takes it
            return False
        return (
            (self.at_least is None or value >= self.at_least)
            and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most)
        )

    def describe(self) -> str:
        one = self._describe_one()
        if not self.many:
            return one
        plural = f"a list of {one.removeprefix('an ').removeprefix('a ')}s"
        return f"{one} or {plural}" if self.one_or_many else plural

    def _describe_one(self) -> str:
        if self.kind == "bool":
            return "true or false"
        if self.kind == "str":
            return f"one of {', '.join(self.choices)}" if self.choices else "a string"
        text = "an integer" if self.kind == "int" else "a number"
        if self.at_least is not None and self.at_most is not None:
            return f"{text} from {_num(self.at_least)} to {_num(self.at_most)}"
        bounds = [
            f"≥ {_num(self.at_least)}" if self.at_least is not None else "",
            f"> {_num(self.above)}" if self.above is not None else "",
            f"≤ {_num(self.at_most)}" if self.at_most is not None else "",
        ]
        return " ".join([text, " and ".join(b for b in bounds if b)]).strip()


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


COUNT = Field("int", at_least=1, at_most=MAX_WIDTH)
HEADS = Field("int", at_least=1, at_most=MAX_HEADS)
EXPERTS = Field("int", at_least=1, at_most=MAX_EXPERTS)
POSITIONS = Field("int", at_least=1, at_most=MAX_POSITIONS)
POSITIVE = Field("number", above=0)
FLAG = Field("bool")

FIELDS: dict[str, Field] = {
    "architectures": Field("str", many=True),
    "model_type": Field("str"),
    "vocab_size": Field("int", at_least=1, at_most=MAX_VOCAB),
    "hidden_size": COUNT,
    "num_hidden_layers": Field("int", at_least=1, at_most=MAX_LAYERS),
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": COUNT,
    "num_local_experts": EXPERTS,
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS,
    "intermediate_size": COUNT,
    "moe_intermediate_size": COUNT,
    "shared_expert_intermediate_size": Field("int", at_least=0, at_most=MAX_WIDTH),
    "decoder_sparse_step": COUNT,
    "mlp_only_layers": Field("int", at_least=0, many=True),
    "layer_types": Field("str", choices=LAYER_TYPES, many=True),
    "max_position_embeddings": POSITIONS,
    "rms_norm_eps": Field("number", above=0, at_most=1),
    "rope_theta": POSITIVE,
    "sliding_window": Field("int", at_least=0, at_most=MAX_POSITIONS),
    "use_sliding_window": FLAG,
    "tie_word_embeddings": FLAG,
    "attention_bias": FLAG,
    "qkv_bias": FLAG,
    "norm_topk_prob": FLAG,
    "clip_qkv": POSITIVE,
    "swiglu_alpha": POSITIVE,
    "swiglu_limit": POSITIVE,
    "bos_token_id": Field("int"),
    "eos_token_id": Field("int", many=True, one_or_many=True),
    # Llama 4
    "interleave_moe_layer_step": COUNT,
    "moe_layers": Field("int", at_least=0, many=True),
    "intermediate_size_mlp": COUNT,
    "no_rope_layers": Field("int", at_least=0, at_most=1, many=True),
    "attention_chunk_size": POSITIONS,
    "use_qk_norm": FLAG,
    "attn_temperature_tuning": FLAG,
    "attn_scale": Field("number", at_least=0),
    "floor_scale": POSITIVE,
    # Phi-3.5-MoE
    "router_jitter_noise": Field("number", at_least=0),
    "lm_head_bias": FLAG,
    # Granite MoE
    "embedding_multiplier": POSITIVE,
    "residual_multiplier": POSITIVE,
    "attention_multiplier": POSITIVE,
    "logits_scaling": POSITIVE,
    # ERNIE 4.5 MoE
    "moe_num_experts": EXPERTS,
    "moe_k": EXPERTS,
    "moe_num_shared_experts": Field("int", at_least=0, at_most=MAX_EXPERTS),
    "moe_layer_start_index": Field("int", at_least=0),
    "moe_layer_end_index": Field("int", at_least=-1),
    "moe_layer_interval": COUNT,
    "moe_norm_min": Field("number", at_least=0),
    "use_bias": FLAG,
    # DeepSeek-V2 / V3, GLM-4.5
    "kv_lora_rank": COUNT,
    "q_lora_rank": COUNT,
    "qk_nope_head_dim": COUNT,
    "qk_rope_head_dim": Field("int", at_least=2, at_most=MAX_WIDTH),
    "v_head_dim": COUNT,
    "n_group": EXPERTS,
    "topk_group": EXPERTS,
    "routed_scaling_factor": POSITIVE,
    "first_k_dense_replace": Field("int", at_least=0),
    "n_shared_experts": Field("int", at_least=0, at_most=MAX_EXPERTS),
    "rope_interleave": FLAG,
    "partial_rotary_factor": Field("number", above=0, at_most=1),
    "topk_method": Field("str"),
}

# inside `rope_parameters` (transformers 5) or `rope_scaling` (older)
ROPE_FIELDS: dict[str, Field] = {
    "architectures": Field("str", many=True),
    "model_type": Field("str"),
    "rope_theta": POSITIVE,
    "rope_type": Field("str", choices=("default", "linear", "yarn", "llama3", "longrope")),
    "type": Field("str", choices=("default", "linear", "yarn", "llama3", "longrope")),
    "short_factor": Field("number", above=0, many=True),  # longrope (Phi-3.5)
    "long_factor": Field("number", above=0, many=True),
    "short_mscale": POSITIVE,
    "long_mscale": POSITIVE,
    "low_freq_factor": POSITIVE,
    "high_freq_factor": POSITIVE,
    "factor": POSITIVE,
    "original_max_position_embeddings": POSITIONS,  # YaRN divides by it
    "beta_fast": POSITIVE,
    "beta_slow": POSITIVE,
    "truncate": FLAG,
    "attention_factor": POSITIVE,
    "mscale": Field("number", at_least=0),  # DeepSeek's YaRN
    "mscale_all_dim": Field("number", at_least=0),
    "partial_rotary_factor": Field("number", above=0, at_most=1),  # GLM-4.5
}


def check_config(config: dict[str, Any], where: str) -> None:
    """Raise ConfigError naming the first field of `config` that no family could use."""
    _check_fields(config, FIELDS, where, "")
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise ConfigError(f'{where}: "{key}" must be an object or null, got {_shown(rope)}')
        _check_fields(rope or {}, ROPE_FIELDS, where, f"{key}.")
    _check_dtype(config, where)
    _check_relations(config, where)


def _check_fields(config: dict[str, Any], fields: dict[str, Field], where: str, prefix: str) -> None:
    for name, spec in fields.items():
        value = config.get(name)
        if value is not None and not spec.ok(value):
            raise ConfigError(f'{where}: "{prefix}{name}" must be {spec.describe()}, got {_shown(value)}')


def _check_dtype(config: dict[str, Any], where: str) -> None:
    from flowmoe.core.spec import DTYPE_BYTES

    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if value is not None and str(value).removeprefix("torch.") not in DTYPE_BYTES:
            raise ConfigError(
                f'{where}: "{name}" must be one of {", ".join(DTYPE_BYTES)}, got {_shown(value)}'
            )


def _check_relations(config: dict[str, Any], where: str) -> None:
    """Limits that depend on another field: top-k within the experts, heads in whole groups."""
    experts = next(
        (config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(k)), None
    )
    top_k = config.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise ConfigError(
            f'{where}: "num_experts_per_tok" must be an integer from 1 to the {experts} experts, got {top_k}'
        )
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            f'{where}: "num_key_value_heads" must divide "num_attention_heads" ({heads}), got {kv_heads}'
        )
    hidden = config.get("hidden_size")
    if not config.get("head_dim") and heads is not None and hidden is not None and hidden % heads:
        raise ConfigError(
            f'{where}: "hidden_size" ({hidden}) must be a multiple of "num_attention_heads" ({heads}) '
            'when "head_dim" is not given'
        )
    layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if types and layers is not None and len(types) != layers:
        raise ConfigError(f'{where}: "layer_types" must name one type per layer ({layers}), got {len(types)}')
    for layer in config.get("mlp_only_layers") or []:
        if layers is not None and layer >= layers:
            raise ConfigError(
                f'{where}: "mlp_only_layers" must hold layer numbers from 0 to {layers - 1}, got {layer}'
            )
    if types and "sliding_attention" in types and config.get("sliding_window") == 0:
        raise ConfigError(f'{where}: "sliding_window" must be ≥ 1 when "layer_types" has sliding layers')


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
