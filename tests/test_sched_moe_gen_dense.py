"""moe-gen's streamed dense parts (issue 28): MoE-Gen's released code copies every MoE layer's attention
and shared expert in like its experts. On the virtual clock (Mixtral-8x7B cut to 3 layers, the T4
roofline, hand-written routing) each layer's dense part crosses the link once a step, during the layer
before's experts, into a buffer of two; for real, eager's tokens either way."""

from __future__ import annotations

import pytest

from flowmoe.core.plan import Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.model.loading import load_model
from flowmoe.schedulers.moe_gen import MoEGenOptions
from flowmoe.study.simulate import simulate
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import run_eager, run_scheduler
from tests.test_sched_successors import COST, SPEC, decode, of, scheduler, trace_of


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v2_lite"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = save_hf(hf_model(request.param), tmp_path_factory.mktemp("moe_gen_dense") / request.param)
    return load_model(folder)


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_each_layers_dense_part_crosses_once_a_step_behind_the_layer_befores_experts(where: str) -> None:
    steps = [decode(4, 2, step=1), decode(4, 2, step=2)]
    routes = {
        (layer, mb): {(mb + layer) % 8: 4, (mb + layer + 3) % 8: 4} for layer in range(3) for mb in range(2)
    }
    sched = scheduler("moe-gen", weights_gpu_share=0.0, attention_on=where)
    assert sched.residency().dense == frozenset()  # every Mixtral layer is a MoE layer
    assert sched.weight_buffer_bytes() == 8 * SPEC.expert_bytes + 2 * SPEC.layer_dense_bytes(0)
    spans = simulate(sched, steps, trace_of(steps, routes), COST)
    dense = sorted((s for s in of(spans, Op.PAGE_COPY) if s.node.expert < 0), key=lambda s: s.start)
    evicts = sorted((s for s in of(spans, Op.EVICT) if s.node.expert < 0), key=lambda s: s.start)
    assert [s.node.layer for s in dense] == [0, 1, 2] * 2 == [s.node.layer for s in evicts]
    assert all(s.node.bytes == SPEC.layer_dense_bytes(s.node.layer) for s in dense)
    for i, copy in enumerate(dense):
        layer = copy.node.layer
        pres = of(spans, Op.PRE_ATTN, layer=layer)
        window = [p for p in pres if copy.end <= p.start <= evicts[i].start]
        assert len(window) == 2 and all(copy.node.id in p.node.deps for p in window)  # both micro-batches
        combines = of(spans, Op.COMBINE, layer=layer)
        ends = {c.node.id for c in combines if copy.end <= c.start and c.end <= evicts[i].start}
        assert len(ends) == 2 and set(evicts[i].node.deps) == ends  # freed after both tails
        if layer > 0:  # issued behind the layer before's expert copies, while its experts compute
            before = [s for s in of(spans, Op.EXPERT_FFN, layer=layer - 1) if s.end <= evicts[i - 1].start]
            assert copy.start < max(s.end for s in before)
        if i >= 2 and layer >= 2:  # two dense parts at most: the slot of the layer two back
            assert evicts[i - 2].node.id in copy.node.deps
    resident = scheduler("moe-gen", weights_gpu_share=0.0, options=(MoEGenOptions(stream_dense=0),))
    assert resident.residency().dense == frozenset(range(3))
    assert resident.weight_buffer_bytes() == 8 * SPEC.expert_bytes


def test_deepseeks_dense_layers_keep_their_dense_part() -> None:
    """DeepSeek-V2-Lite's first layer has a dense MLP: it stays resident, every MoE layer streams."""
    from flowmoe.core.cost import RooflineCost
    from flowmoe.core.hardware import hardware
    from flowmoe.core.scheduling import NodeFactory, SchedulerContext
    from flowmoe.schedulers.registry import create

    spec = preset("deepseek-v2-lite", layers=4)
    context = SchedulerContext(
        spec, Policy(weights_gpu_share=0.0), NodeFactory(spec), RooflineCost(hardware("t4"), spec)
    )
    sched = create("moe-gen", context)
    assert sched.residency().dense == frozenset({0})
    assert sched.weight_buffer_bytes() == spec.moe.experts * spec.expert_bytes + 2 * spec.layer_dense_bytes(1)


@pytest.mark.parametrize("stream", [1, 0])
def test_streamed_or_resident_dense_parts_give_eager_tokens(model, stream: int) -> None:
    policy = Policy(3, 2, weights_gpu_share=0.0, options=(MoEGenOptions(stream_dense=stream),))
    (results, _), runtime = run_scheduler(model, "moe-gen", policy, device="cpu")
    copied = {s.node.layer for s in runtime.trace.spans if s.node.op is Op.PAGE_COPY and s.node.expert < 0}
    spec = runtime.model.spec
    moe = {layer for layer in range(spec.layers) if spec.is_moe_layer(layer)}
    assert copied == (moe if stream else set())
    assert [r.output_ids for r in results] == [r.output_ids for r in run_eager(model)[0]]
