"""`flowmoe reproduce generic-offloaders`: the published batch-1 figures at 8 and 64 experts per layer, each
with the hooks' host costs, without them ("(ideal)") and as the old `on-demand` stand-in."""

from __future__ import annotations

from flowmoe.study.reproduce import settings
from flowmoe.study.reproduce.run import measured, run_system
from flowmoe.study.reproduce.successor_numbers import MOE_GEN_SMALL


def test_the_quick_setting_prices_the_hooks_and_sits_closer_to_the_paper_than_an_ideal_pipeline() -> None:
    (setting,) = settings("generic-offloaders", quick=True)
    hooks, ideal, on_demand = setting.systems
    assert on_demand.scheduler == "on-demand"
    assert hooks.published == MOE_GEN_SMALL[("deepseek-v2-lite", 1)]["DeepSpeed"]
    assert hooks.setup.host_costs and not ideal.setup.host_costs
    assert hooks.given.options == {"fused_experts": 0, "offload_dense": 1}  # ZeRO-3 moves the dense parts too
    rates = [measured(s, run_system(s)) for s in setting.systems]
    assert all(r is not None for r in rates)
    with_costs, without, pipelined = (float(r or 0) for r in rates)
    assert with_costs < without < pipelined  # the host costs, then the lost overlap and pageable copies
    assert abs(with_costs / hooks.published - 1) < abs(pipelined / hooks.published - 1)


def test_every_setting_has_one_published_figure_and_two_references() -> None:
    full = settings("generic-offloaders")
    assert {s.name.split(" ")[0] for s in full} == {"mixtral-8x7b", "deepseek-v2-lite"}
    for setting in full:
        assert [s.published is not None for s in setting.systems] == [True, False, False]
