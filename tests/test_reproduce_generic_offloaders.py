"""`flowmoe reproduce generic-offloaders`: the published batch-1 figures at 8 and 64 experts per layer, each
with the hooks' host costs, without them ("(ideal)") and as the old `on-demand` stand-in; MoE-Infinity's
README rows beside them, Accelerate's at `device_map="auto"`'s share; its DeepSpeed row at 128 experts
(Qwen3-30B-A3B), every expert module called; Accelerate's own offload measured on an H200."""

from __future__ import annotations

import pytest

from flowmoe.core.hardware import hardware
from flowmoe.core.presets import preset
from flowmoe.study.reproduce import settings
from flowmoe.study.reproduce.generic_offloader_numbers import (
    H200_ACCELERATE,
    H200_ACCELERATE_TOKENS_PER_S,
    H200_LAYERS,
    H200_LONGEST_PROMPT,
    H200_MAX_MEMORY,
    H200_PROMPTS,
    MOE_INFINITY,
    MOE_INFINITY_LATENCY,
    MOE_INFINITY_LEGACY,
    QWEN3_DEEPSPEED_LATENCY,
)
from flowmoe.study.reproduce.generic_offloaders import DEVICE_MAP_STORE, HOOKS, device_map_share
from flowmoe.study.reproduce.run import measured, run_system
from flowmoe.study.reproduce.successor_numbers import MOE_GEN, MOE_GEN_SMALL


def test_the_quick_setting_prices_the_hooks_and_sits_closer_to_the_paper_than_an_ideal_pipeline() -> None:
    (setting,) = settings("generic-offloaders", quick=True)
    hooks, ideal, on_demand = setting.systems
    assert on_demand.scheduler == "on-demand" and hooks.scheduler == ideal.scheduler == "zero-inference"
    assert hooks.published == MOE_GEN_SMALL[("deepseek-v2-lite", 1)]["DeepSpeed"]
    assert hooks.setup.host_costs and not ideal.setup.host_costs
    assert hooks.given.options == {"fused_experts": 0, "offload_dense": 1}  # ZeRO-3 moves the dense parts too
    rates = [measured(s, run_system(s)) for s in setting.systems]
    assert all(r is not None for r in rates)
    with_costs, without, pipelined = (float(r or 0) for r in rates)
    assert with_costs < without < pipelined  # ZeRO-3's hook costs, then the lost overlap
    assert abs(with_costs / hooks.published - 1) < abs(pipelined / hooks.published - 1)


def test_moe_gen_settings_have_one_published_figure_and_moe_infinity_settings_two_as_inverse_latency() -> (
    None
):
    full = settings("generic-offloaders")
    assert {s.name.split(" ")[0] for s in full} == {"mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b"}
    assert len(full) == 6
    moe_gen = [s for s in full if s.where.startswith(MOE_GEN)]
    moe_infinity = [s for s in full if s.where == MOE_INFINITY]
    assert len(moe_gen) == len(moe_infinity) == 2
    for setting in moe_gen:
        assert [s.published is not None for s in setting.systems] == [True, False, False]
    for setting in moe_infinity:
        deepspeed, accelerate, every = setting.systems
        latency = MOE_INFINITY_LATENCY[setting.name.split(" ")[0]]
        assert deepspeed.published == pytest.approx(1 / latency["DeepSpeed"])
        assert accelerate.published == pytest.approx(1 / latency["Accelerate"]) and every.published is None
        assert deepspeed.given == HOOKS and deepspeed.given.weights_gpu_share == 0.0
        assert accelerate.given.options == {"fused_experts": 0, "offload_dense": 1}
        assert every.given.options == {**accelerate.given.options, "empty_calls": 1}
        assert 0 < accelerate.given.weights_gpu_share == every.given.weights_gpu_share < 1


def test_the_128_expert_row_calls_every_expert_module_and_shows_the_other_transformers_versions() -> None:
    (setting,) = [s for s in settings("generic-offloaders") if s.where == MOE_INFINITY_LEGACY]
    every, routed, fused = setting.systems
    assert setting.name.startswith("qwen3-30b-a3b") and every.setup.spec.moe.experts == 128
    assert every.published == pytest.approx(1 / QWEN3_DEEPSPEED_LATENCY)
    assert routed.published is None and fused.published is None  # references, not counted
    assert routed.given == HOOKS and every.given.weights_gpu_share == 0.0
    assert every.given.options == {**HOOKS.options, "empty_calls": 1}
    assert fused.given.options == {**HOOKS.options, "fused_experts": 1}


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_device_map_share_fills_ninety_percent_of_the_gpu_less_the_largest_layer_with_whole_layers(
    model: str,
) -> None:
    spec, hw = preset(model), hardware("moe-gen-c1")
    share = device_map_share(spec, hw)
    moe = [i for i in range(spec.layers) if spec.is_moe_layer(i)]
    placed = moe[round(share * len(moe)) - 1] + 1  # layers on the GPU: up to the last resident MoE layer
    layer = [spec.layer_dense_bytes(i) + spec.layer_expert_bytes(i) for i in range(spec.layers)]
    room = DEVICE_MAP_STORE * hw.gpu_memory - max(layer) - spec.vocab * spec.hidden * spec.dtype_bytes
    assert sum(layer[:placed]) <= room < sum(layer[: placed + 1])
    assert device_map_share(spec, hardware("a100-80")) > share


def test_the_h200_row_is_the_measured_accelerate_run_with_its_device_map_and_longest_prompt() -> None:
    """bench/gpu.py's prompts (requests_for(32, 128, vocab): lengths from torch's generator at seed 0)
    padded to the longest; device_map at 90% of 16 GiB holds the embedding and 4 of the 12 layers (the 5
    of 16 entries the run recorded); transformers 5.x's fused experts, whole layers offloaded."""
    torch = pytest.importorskip("torch")
    lengths = torch.randint(64, 192, (H200_PROMPTS,), generator=torch.Generator().manual_seed(0))
    assert int(lengths.max()) == H200_LONGEST_PROMPT
    (setting,) = [s for s in settings("generic-offloaders") if s.where == H200_ACCELERATE]
    measured_row, ideal = setting.systems
    spec = measured_row.setup.spec
    assert spec.layers == H200_LAYERS and measured_row.setup.hardware.name == "h200"
    assert measured_row.published == H200_ACCELERATE_TOKENS_PER_S and ideal.published is None
    assert measured_row.given.weights_gpu_share == pytest.approx(4 / 12)
    assert device_map_share(spec, hardware("h200"), H200_MAX_MEMORY) == pytest.approx(4 / 12)
    assert measured_row.given.options == {"fused_experts": 1, "offload_dense": 1}
    assert measured_row.given.batch_size == H200_PROMPTS and measured_row.given.micro_batches == 1
    assert measured_row.setup.host_costs and not ideal.setup.host_costs
