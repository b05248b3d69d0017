"""DeepSeek-V2 and DeepSeek-V3 (Kimi K2 is a V3): multi-head latent attention, shared experts, the first
`first_k_dense_replace` layers dense, and a group-limited router.

V3's router: sigmoid scores; `e_score_correction_bias` added for the choice only; experts in `n_group`
groups, the `topk_group` groups with the highest sum of their two best scores kept; top-k of those;
the chosen scores renormalised (`norm_topk_prob`) and multiplied by `routed_scaling_factor`.
V2's router: softmax scores; top-k over all experts (`greedy`) or within the `topk_group` groups with the
highest best score (`group_limited_greedy`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import math
from typing import Any

from attrs import evolve

from flowmoe.core.errors import ConfigError
from flowmoe.core.families.base import Family, TensorNames, common_fields, num_experts, rope_from_config
from flowmoe.core.spec import AttentionSpec, MLASpec, ModelSpec, MoESpec, RopeSpec, RouterKind

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# transformers' defaults for fields a config.json leaves out (a null q_lora_rank: no q LoRA)
MLA_DEFAULTS = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}  # fmt: skip
V3_DEFAULTS = {**MLA_DEFAULTS, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
               "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True}  # fmt: skip
V2_DEFAULTS = {**MLA_DEFAULTS, "n_shared_experts": 2, "routed_scaling_factor": 1.0}


def _mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_rope(config: dict[str, Any], where: str) -> tuple[RopeSpec, float]:
    """RoPE of the decoupled key and the softmax scale's YaRN factor (mscale_all_dim squared).

    DeepSeek's YaRN: a missing `factor` is max_position_embeddings / original_max_position_embeddings;
    cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "yarn":  # transformers scales the softmax by mscale_all_dim with any scaled RoPE
        mscale_all, factor = params.get("mscale_all_dim"), float(params.get("factor") or 1.0)
        scale = _mscale(factor, mscale_all) ** 2 if kind != "default" and mscale_all else 1.0
        return rope_from_config(config, default_theta=10000.0), scale
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ConfigError(f'{where}: yarn "rope_parameters" needs "original_max_position_embeddings"')
    factor = float(params.get("factor") or int(config["max_position_embeddings"]) / int(original))
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            _mscale(factor, mscale) / _mscale(factor, mscale_all)
            if mscale and mscale_all
            else _mscale(factor, 1)
        )
    scaled = {**params, "factor": factor, "attention_factor": attention_factor}
    rope = rope_from_config(
        {**config, "rope_scaling": None, "rope_parameters": scaled}, default_theta=10000.0
    )
    return rope, _mscale(factor, mscale_all) ** 2 if mscale_all else 1.0


def _mla(config: dict[str, Any], where: str, interleave: bool) -> tuple[AttentionSpec, RopeSpec]:
    if config.get("attention_bias"):
        raise ConfigError(f'{where}: "attention_bias": true is not supported for multi-head latent attention')
    heads = int(config["num_attention_heads"])
    rope, mscale2 = mla_rope(config, where)
    mla = MLASpec(
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        rope_interleave=interleave,
    )
    mla = evolve(mla, softmax_scale=mla.qk_head_dim**-0.5 * mscale2)
    # kv_heads / head_dim stand for the cache's one latent "head" of cache_dim elements
    attention = AttentionSpec(heads=heads, kv_heads=1, head_dim=mla.qk_rope_head_dim, mla=mla)
    return attention, rope


def _moe(config: dict[str, Any], where: str, router: RouterKind, norm_topk: bool) -> MoESpec:
    experts = num_experts(config)
    groups = int(config.get("n_group") or 1)
    if experts % groups:
        raise ConfigError(f'{where}: "n_group" ({groups}) must divide the {experts} routed experts')
    inter = int(config["moe_intermediate_size"])
    dense = min(int(config.get("first_k_dense_replace") or 0), int(config["num_hidden_layers"]))
    return MoESpec(
        experts=experts,
        top_k=int(config["num_experts_per_tok"]),
        intermediate=inter,
        router=router,
        norm_topk=norm_topk,
        combine_fp32=True,  # the router's weights are float32 and scale the expert outputs as such
        selection_bias=router == "sigmoid_group",
        n_group=groups,
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling=float(config.get("routed_scaling_factor") or 1.0),
        shared_intermediate=inter * int(config.get("n_shared_experts") or 0),
        dense_layers=tuple(range(dense)),
        dense_intermediate=int(config.get("intermediate_size", 0)),
    )


def _check_groups(config: dict[str, Any], where: str) -> None:
    groups, top = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if top > groups:
        raise ConfigError(f'{where}: "topk_group" must be from 1 to "n_group" ({groups}), got {top}')


def parse_v3(config: dict[str, Any], name: str, where: str = "config") -> ModelSpec:
    config = {**V3_DEFAULTS, **config}
    _check_groups(config, where)
    attention, rope = _mla(config, where, interleave=bool(config.get("rope_interleave", True)))
    experts, groups = num_experts(config), int(config.get("n_group") or 1)
    if experts // groups < 2:
        raise ConfigError(f'{where}: "n_group" must leave at least 2 experts per group, got {groups}')
    return ModelSpec(
        **common_fields(config, name, "deepseek_v3"),
        attention=attention,
        rope=rope,
        moe=_moe(config, where, "sigmoid_group", norm_topk=bool(config.get("norm_topk_prob", True))),
    )


def parse_v2(config: dict[str, Any], name: str, where: str = "config") -> ModelSpec:
    config = {**V2_DEFAULTS, **config}
    _check_groups(config, where)
    method = config.get("topk_method") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ConfigError(
            f'{where}: "topk_method" must be one of {", ".join(V2_TOPK_METHODS)}, got {method!r}'
        )
    if config.get("norm_topk_prob"):
        raise ConfigError(
            f'{where}: "norm_topk_prob": true is not supported for DeepseekV2 (transformers ignores it)'
        )
    attention, rope = _mla(config, where, interleave=True)  # V2 rotates (x0, x1) pairs as complex numbers
    if method == "greedy":
        config = {**config, "n_group": 1, "topk_group": 1}
    return ModelSpec(
        **common_fields(config, name, "deepseek_v2"),
        attention=attention,
        rope=rope,
        moe=_moe(config, where, "softmax_group", norm_topk=False),
    )


NAMES = TensorNames(
    shared_expert="shared_experts", selection_bias="gate.e_score_correction_bias", selection_bias_rows=False
)

V2 = Family(
    name="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    parse=parse_v2,
    names=NAMES,
)
V3 = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"),
    parse=parse_v3,
    names=NAMES,
)
