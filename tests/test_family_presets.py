"""The Llama 4, Phi-3.5-MoE, Granite MoE and ERNIE 4.5 presets at their real shapes, and the config
variants those families do not run, each refused in one line naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from flowmoe.core.errors import ConfigError
from flowmoe.core.presets import PRESET_CONFIGS, preset
from flowmoe.core.spec import ModelSpec
from tests.hf_models import COMMON

# preset -> (expert FFN width, routed experts, published total parameters in billions: the model cards,
# Llama 4 Scout's 109B counting its vision encoder, about 1B)
SHAPES = {
    "llama-4-scout": ("intermediate_size", "num_local_experts", 108.0),
    "llama-4-maverick": ("intermediate_size", "num_local_experts", 400.0),
    "phi-3.5-moe": ("intermediate_size", "num_local_experts", 41.9),
    "ernie-4.5-21b-a3b": ("moe_intermediate_size", "moe_num_experts", 21.0),
    "granite-3.0-3b-a800m": ("intermediate_size", "num_local_experts", 3.3),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bytes_per_expert_and_kv_bytes_per_token_follow_the_config(name: str) -> None:
    config, spec = PRESET_CONFIGS[name], preset(name)
    inter_key, experts_key, billions = SHAPES[name]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    assert spec.dtype_bytes == 2
    assert spec.expert_bytes == 3 * hidden * config[inter_key] * 2  # gate, up, down in bfloat16
    assert spec.moe.experts == config[experts_key]
    assert spec.kv_bytes_per_token == 2 * config["num_key_value_heads"] * head_dim * layers * 2
    assert spec.total_bytes / 2 / 1e9 == pytest.approx(billions, rel=0.05)


def test_llama4_layers_interleave_and_skip_rope_as_configured() -> None:
    scout, maverick = preset("llama-4-scout"), preset("llama-4-maverick")
    assert scout.moe.dense_layers == () and scout.moe.shared_intermediate == 8192
    assert maverick.moe.dense_layers == tuple(range(0, 48, 2)) and maverick.moe.dense_intermediate == 16384
    for spec in (scout, maverick):
        assert spec.attention.nope_layers == tuple(range(3, 48, 4))
        assert [spec.attention.chunk(i) for i in range(4)] == [8192, 8192, 8192, None]
    assert scout.attention.qk_norm == "l2" and maverick.attention.qk_norm == "none"
    assert scout.rope.kind == "llama3" and maverick.rope.kind == "default"
    assert scout.with_layers(6).attention.nope_layers == (3,)


def test_ernie_starts_its_moe_layers_at_moe_layer_start_index() -> None:
    spec = preset("ernie-4.5-21b-a3b")
    assert spec.moe.dense_layers == (0,) and spec.moe.selection_bias
    assert spec.moe.shared_intermediate == 2 * 1536 and spec.tie_embeddings


def test_granite_and_phi_read_their_extras() -> None:
    granite, phi = preset("granite-3.0-3b-a800m"), preset("phi-3.5-moe")
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_divisor) == (
        12.0,
        0.22,
        6.0,
    )
    assert granite.attention.scale == 0.015625
    assert phi.norm == "layer" and phi.lm_head_bias and phi.moe.router == "sparsemixer"


def _config(arch: str, **extra: Any) -> dict[str, Any]:
    base = {**COMMON, "architectures": [arch], "intermediate_size": 32, "num_local_experts": 4}
    return {**base, "num_experts_per_tok": 2, **extra}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (_config("PhimoeForCausalLM", num_experts_per_tok=3), '"num_experts_per_tok"'),
        (_config("Llama4ForCausalLM", hidden_act="gelu"), '"hidden_act"'),
        (_config("Llama4ForCausalLM", no_rope_layers=[1, 0]), '"no_rope_layers"'),
        (_config("Llama4ForCausalLM", moe_layers=[1, 5]), '"moe_layers"'),
        (_config("Llama4ForCausalLM", layer_types=["sliding_attention"] * 3), '"layer_types"'),
        (_config("Llama4ForCausalLM", floor_scale=0), '"floor_scale"'),
        (_config("GraniteMoeForCausalLM", residual_multiplier=-1.0), '"residual_multiplier"'),
        (_config("Ernie4_5_MoeForCausalLM", moe_intermediate_size=16, use_bias=True), '"use_bias"'),
        (_config("Ernie4_5_MoeForCausalLM", moe_intermediate_size=16, moe_num_experts=4, moe_k=5), '"moe_k"'),
        (_config("PhimoeForCausalLM", rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.type"),
        (
            _config("PhimoeForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0]}),
            "short_factor",
        ),
    ],
)
def test_unsupported_variants_fail_naming_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ModelSpec.from_hf(config)
    message = str(caught.value)
    assert field in message and "\n" not in message
