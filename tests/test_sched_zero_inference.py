"""zero-inference: DeepSpeed ZeRO-Inference's fetch hooks on the virtual clock (Accelerate's plan, copies
from pinned memory, ZeRO-3's measured hook costs), and its tokens, which must be eager's."""

from __future__ import annotations

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.host_costs import DEEPSPEED, ZERO3_EXPERT_CALL_S, ZERO3_LINEAR_S, ZERO3_MODULE_S, family
from flowmoe.core.plan import Op
from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.schedulers.accelerate import AccelerateOptions
from flowmoe.study.simulate import simulate
from tests.schedule_fixtures import run_eager, run_scheduler
from tests.test_sched_baselines import COST, ROUTES, SPEC, decode, of, prefill, scheduler, trace_of

OPTIONS = (AccelerateOptions(fused_experts=0, offload_dense=1),)


def spans_of(name: str, cost: RooflineCost = COST):
    steps = [prefill(4, 256), decode(4, 256)]
    sched = scheduler(name, weights_gpu_share=1 / 3, options=OPTIONS)
    return simulate(sched, steps, trace_of(steps, ROUTES), cost)


def test_the_plan_is_accelerates_with_every_copy_pinned() -> None:
    ours, theirs = spans_of("zero-inference"), spans_of("accelerate")
    assert [s.node.op for s in ours] == [s.node.op for s in theirs]
    copies = of(ours, Op.PAGE_COPY)
    assert copies and all(c.node.sync and not c.node.pageable for c in copies)
    assert all(c.node.pageable for c in of(theirs, Op.PAGE_COPY))


def test_zero3_hooks_price_an_expert_call_on_its_three_copies_and_a_dense_part_as_its_modules() -> None:
    base = RooflineCost(hardware("moe-gen-c1"), SPEC)
    priced = evolve(base, host=family("deepspeed"))
    spans = spans_of("zero-inference", base)
    expert = [c.node for c in of(spans, Op.PAGE_COPY) if c.node.expert >= 0]
    dense = [c.node for c in of(spans, Op.PAGE_COPY) if c.node.expert < 0]
    assert expert and dense
    assert sum(priced(n) - base(n) for n in expert[:3]) == pytest.approx(ZERO3_EXPERT_CALL_S)
    assert priced(dense[0]) - base(dense[0]) == pytest.approx(7 * ZERO3_MODULE_S + 4 * ZERO3_LINEAR_S)
    ffn = of(spans, Op.EXPERT_FFN)[0].node
    assert priced(ffn) == base(ffn)  # the hooks are on the copies: an empty call pays them too
    assert DEEPSPEED.per_pageable_byte == 0.0 and DEEPSPEED.source
    assert pytest.approx(2.0395e-3, rel=1e-3) == ZERO3_EXPERT_CALL_S  # 2 x 205.5 us + 3 x 542.8 us


@pytest.mark.parametrize(("model_family", "share"), [("mixtral", 0.0), ("deepseek_v2_lite", 0.5)])
def test_zero_inference_gives_eager_tokens(
    model_family: str, share: float, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.hf_models import hf_model, save_hf

    model = load_model(save_hf(hf_model(model_family), tmp_path_factory.mktemp("zero") / model_family))
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=share, options=OPTIONS)
    (results, _), _ = run_scheduler(model, "zero-inference", policy, device="cpu")
    (reference, _) = run_eager(model)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
