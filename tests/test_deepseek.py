"""DeepSeek-V2/V3, Kimi K2 and GLM-4.5: presets at their real shapes, the latent KV cache, the
group-limited router, a CPU-attention schedule over latents, and the config variants refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowmoe.core.errors import ConfigError
from flowmoe.core.policy import Policy
from flowmoe.core.presets import PRESET_CONFIGS, preset
from flowmoe.core.spec import ModelSpec, MoESpec
from flowmoe.kernels.router import choose
from flowmoe.model.loading import load_model
from tests.hf_models import COMMON, DEEPSEEK, hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_scheduler

# preset -> published total parameters in billions (the model cards and papers; DeepSeek-V3's 671B and
# GLM-4.5's 355B leave out or include, respectively, a ~2-14B multi-token-prediction layer flowmoe
# does not run: GLM's is within the tolerance)
TOTALS = {
    "deepseek-v3": 671.0,
    "kimi-k2": 1026.0,
    "deepseek-v2-lite": 15.7,
    "glm-4.5": 355.0,
    "glm-4.5-air": 106.0,
    "qwen3-235b-a22b": 235.0,
}


def _expert_width(config: dict[str, Any]) -> tuple[int, int]:
    experts = config.get("n_routed_experts") or config["num_experts"]
    return config["moe_intermediate_size"], experts


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_bytes_per_expert_and_kv_bytes_per_token_follow_the_config(name: str) -> None:
    config, spec = PRESET_CONFIGS[name], preset(name)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inter, experts = _expert_width(config)
    assert spec.dtype_bytes == 2
    assert spec.expert_bytes == 3 * hidden * inter * 2  # gate, up, down in bfloat16
    assert spec.moe.experts == experts
    if "kv_lora_rank" in config:  # MLA caches the latent and the RoPE key, nothing per head
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        per_layer = 2 * config["num_key_value_heads"] * config["head_dim"]
    assert spec.kv_bytes_per_token == per_layer * layers * 2
    assert spec.total_bytes / 2 / 1e9 == pytest.approx(TOTALS[name], rel=0.015)


def test_deepseek_v3_reads_its_router_and_yarn() -> None:
    spec = preset("deepseek-v3")
    m, a = spec.moe, spec.attention
    assert (m.router, m.n_group, m.topk_group, m.routed_scaling, m.norm_topk) == (
        "sigmoid_group",
        8,
        4,
        2.5,
        True,
    )
    assert m.selection_bias and m.dense_layers == (0, 1, 2) and m.shared_intermediate == 2048
    assert spec.kv_bytes_per_token == 70272  # 576 latent + RoPE elements × 61 layers × 2 bytes
    assert spec.rope.kind == "yarn" and spec.rope.factor == 40 and spec.rope.attention_factor == 1.0
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert a.mla is not None and a.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert spec.with_layers(2).moe.dense_layers == (0, 1)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_hf(hf_model("deepseek_v3"), tmp_path_factory.mktemp("deepseek") / "deepseek_v3"))


def test_the_cache_holds_latents(deepseek_v3) -> None:
    model = deepseek_v3
    cache = model.new_cache(2, 10)
    assert cache.keys[0].shape == (2, 1, 10, DEEPSEEK["kv_lora_rank"])
    assert cache.values[0].shape == (2, 1, 10, DEEPSEEK["qk_rope_head_dim"])
    assert cache.nbytes == model.spec.kv_bytes_per_token * 2 * 10


def _moe(**kw: Any) -> MoESpec:
    base = {
        "experts": 8,
        "top_k": 2,
        "intermediate": 4,
        "router": "sigmoid_group",
        "n_group": 4,
        "topk_group": 1,
    }
    return MoESpec(**{**base, **kw})


def test_selection_bias_chooses_but_never_weighs() -> None:
    x, weight = torch.randn(5, 6), torch.randn(8, 6)
    bias = torch.zeros(8)
    bias[6:] = 100.0  # experts 6 and 7 (group 3) always chosen, weighed by their unbiased scores
    indices, weights = choose(x, weight, None, _moe(norm_topk=False, routed_scaling=3.0), bias)
    assert sorted(indices[0].tolist()) == [6, 7]
    scores = torch.sigmoid(x @ weight.t())
    assert torch.allclose(weights, scores.gather(1, indices) * 3.0)


def test_experts_outside_the_kept_groups_are_never_chosen() -> None:
    x, weight = torch.randn(64, 6), torch.randn(8, 6)
    for router in ("sigmoid_group", "softmax_group"):
        indices, _ = choose(x, weight, None, _moe(router=router, top_k=3, n_group=4, topk_group=2))
        groups = indices // 2  # [T, k] each expert's group
        assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_cpu_attention_over_latents_gives_eager_tokens(deepseek_v3) -> None:
    """FlexGen with attention on the CPU: the latents and RoPE keys stay in host memory and q goes
    down; the tokens and logits equal eager's."""
    model = deepseek_v3
    ref_results, _ = run_eager(model)
    for policy in (Policy(micro_batch_size=3, micro_batches=2, attention_on="cpu"),
                   Policy(micro_batch_size=3, micro_batches=2, kv_gpu_share=0.0)):  # fmt: skip
        (results, _), _ = run_scheduler(model, "flexgen", policy)
        assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]


def _config(arch: str, **extra: Any) -> dict[str, Any]:
    return {"architectures": [arch], **COMMON, **DEEPSEEK, "n_group": 2, "topk_group": 1, **extra}


@pytest.mark.parametrize(
    ("arch", "extra", "field"),
    [
        ("DeepseekV3ForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("DeepseekV3ForCausalLM", {"n_group": 8}, "n_group"),
        ("DeepseekV3ForCausalLM", {"n_group": 3}, "n_group"),
        ("DeepseekV3ForCausalLM", {"topk_group": 4}, "topk_group"),
        ("DeepseekV3ForCausalLM", {"kv_lora_rank": 0}, "kv_lora_rank"),
        ("DeepseekV3ForCausalLM", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position"),
        ("DeepseekV2ForCausalLM", {"topk_method": "noaux_tc"}, "topk_method"),
        ("DeepseekV2ForCausalLM", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("Glm4MoeForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ],
)
def test_unsupported_variants_fail_in_one_line_naming_the_field(arch: str, extra: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_hf(_config(arch, **extra))
    message = str(info.value)
    assert field in message and "\n" not in message


def test_deepseek_v3_fits_the_papers_machine_with_fp8_experts() -> None:
    """1.34 TB of bfloat16 weights exceed h100's 1 TiB of host memory; as FP8 they fit, and the plan
    homes the experts so by default."""
    from flowmoe.core.hardware import hardware
    from flowmoe.core.memory import fitting_expert_format
    from flowmoe.core.policy_search import search
    from flowmoe.core.workloads import workload

    h100, mtbench = hardware("h100"), workload("mtbench")
    assert fitting_expert_format(preset("deepseek-v3"), h100) == "fp8"
    assert fitting_expert_format(preset("mixtral-8x7b"), h100) == "native"
    with pytest.raises(ConfigError, match="no policy fits"):
        search(preset("deepseek-v3"), h100, mtbench)
    plan = search(preset("deepseek-v3"), h100, mtbench, expert_format="fp8")
    assert plan.best.cpu_bytes <= 0.8 * h100.cpu_memory
