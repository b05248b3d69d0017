"""accelerate: Accelerate's offload hooks on the virtual clock (no overlap, one tensor per synchronous
pageable copy, the whole experts module per call when fused), its host costs, and its tokens with one
module per expert (the contract test runs the default, fused)."""

from __future__ import annotations

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.host_costs import (
    ACCELERATE,
    H200_EXPERT_BYTES,
    H200_EXPERT_HOOKED_S,
    H200_HOOK_PER_CALL_S,
    H200_HOOK_PER_TENSOR_S,
    H200_PAGEABLE_PEAK,
    IDEAL,
    family,
)
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.schedulers.accelerate import AccelerateOptions
from flowmoe.study.simulate import simulate
from tests.schedule_fixtures import run_eager, run_scheduler
from tests.test_sched_baselines import (
    COST,
    ROUTES,
    SPEC,
    E,
    by_id,
    decode,
    of,
    overlaps,
    prefill,
    scheduler,
    trace_of,
)


def accelerate_run(fused: int, share: float = 0.0, cost: RooflineCost = COST, empty_calls: int = 0):
    steps = [prefill(4, 256), decode(4, 256)]
    options = (AccelerateOptions(fused_experts=fused, empty_calls=empty_calls),)
    sched = scheduler("accelerate", weights_gpu_share=share, options=options)
    return sched, simulate(sched, steps, trace_of(steps, ROUTES), cost)


def test_one_module_per_expert_copies_each_routed_expert_tensor_by_tensor_with_nothing_overlapping() -> None:
    sched, spans = accelerate_run(fused=0)
    copies = of(spans, Op.PAGE_COPY)
    assert len(copies) == 3 * 2 * sum(len(v) for v in ROUTES.values())  # w1, w3, w2 of each routed expert
    assert all(c.node.pageable and c.node.sync and c.node.parts == 3 for c in copies)
    busy = [s for s in spans if s.node.op in (Op.PAGE_COPY, Op.EXPERT_FFN)]
    assert not any(
        overlaps(a, b) for i, a in enumerate(busy) for b in busy[i + 1 :]
    )  # copy, compute, copy...
    ids = by_id(spans)
    for ffn in of(spans, Op.EXPERT_FFN):
        (copy,) = [ids[d] for d in ffn.node.deps if ids[d].node.op is Op.PAGE_COPY]
        assert copy.node.expert == ffn.node.expert and copy.node.part == 2  # after its module's last tensor
    assert sched.weight_buffer_bytes() == SPEC.expert_bytes


def test_fused_experts_module_copies_every_expert_of_the_layer_whatever_the_router_chose() -> None:
    sched, spans = accelerate_run(fused=1)
    copies = of(spans, Op.PAGE_COPY)
    assert len(copies) == 2 * 3 * 2 * 2  # 2 tensors x 3 layers x 2 micro-batches x 2 steps
    assert all(
        c.node.experts == tuple(range(E)) and c.node.bytes == E * SPEC.expert_bytes // 2 for c in copies
    )
    assert len(of(spans, Op.EVICT)) == E * len(copies) // 2
    assert sched.weight_buffer_bytes() == E * SPEC.expert_bytes


def test_empty_calls_copy_and_free_every_expert_module_in_index_order_and_compute_only_the_routed() -> None:
    sched, spans = accelerate_run(fused=0, share=1 / 3, empty_calls=1)
    copies, ffns = of(spans, Op.PAGE_COPY), of(spans, Op.EXPERT_FFN)
    offloaded = [(layer, mb) for layer, mb in ROUTES if layer > 0]
    assert len(copies) == 2 * len(offloaded) * E * 3  # 2 steps, every expert's w1, w3, w2
    assert len(of(spans, Op.EVICT)) == 2 * len(offloaded) * E
    for layer, mb in offloaded:
        step = sorted((s for s in copies if (s.node.layer, s.node.mb) == (layer, mb)), key=lambda s: s.start)
        assert [s.node.expert for s in step[: 3 * E]] == [e for e in range(E) for _ in range(3)]
        computed = {s.node.expert for s in ffns if (s.node.layer, s.node.mb) == (layer, mb)}
        assert computed == set(ROUTES[(layer, mb)])
    busy = [s for s in spans if s.node.op in (Op.PAGE_COPY, Op.EXPERT_FFN)]
    assert not any(overlaps(a, b) for i, a in enumerate(busy) for b in busy[i + 1 :])
    assert sched.weight_buffer_bytes() == SPEC.expert_bytes  # one expert module at a time, as before
    _, routed_only = accelerate_run(fused=0, share=1 / 3)
    assert max(s.end for s in spans) > max(s.end for s in routed_only)
    with pytest.raises(ConfigError, match="--empty-calls 1 needs --fused-experts 0"):
        accelerate_run(fused=1, empty_calls=1)


def test_the_first_weights_share_of_the_moe_layers_keeps_its_experts_and_copies_nothing() -> None:
    sched, spans = accelerate_run(fused=0, share=2 / 3)
    assert {c.node.layer for c in of(spans, Op.PAGE_COPY)} == {2}
    assert len(sched.residency().experts) == 2 * E


def test_host_costs_price_each_tensor_and_module_call_and_can_be_switched_off() -> None:
    base = RooflineCost(hardware("t4"), SPEC)
    priced = evolve(base, host=ACCELERATE)
    _, spans = accelerate_run(fused=0, cost=base)
    copy, ffn = of(spans, Op.PAGE_COPY)[0].node, of(spans, Op.EXPERT_FFN)[0].node
    assert copy.pageable
    assert priced(copy) - base(copy) == pytest.approx(
        ACCELERATE.per_transfer + ACCELERATE.per_pageable_byte * copy.bytes
    )
    assert priced(evolve(copy, pageable=False)) - base(evolve(copy, pageable=False)) == pytest.approx(
        ACCELERATE.per_transfer
    )
    assert priced(ffn) - base(ffn) == pytest.approx(ACCELERATE.per_call)
    gate = of(spans, Op.GATE)[0].node
    assert priced(gate) == base(gate) and IDEAL(copy) == 0.0
    assert ACCELERATE.source and family("accelerate") is ACCELERATE
    with pytest.raises(ConfigError, match="unknown host-cost family 'nope'"):
        family("nope")


def test_the_per_byte_cost_gives_back_the_measured_hooked_expert_module_on_the_h200_host() -> None:
    """A hooked Mixtral expert module (hooks.json) = its fixed hook costs + the bytes at the measured
    pageable peak + the per-byte cost; with the h200 preset's pageable rate, ~7.6 GB/s in all."""
    measured = H200_EXPERT_BYTES * ACCELERATE.per_pageable_byte + H200_EXPERT_BYTES / H200_PAGEABLE_PEAK
    assert measured + 3 * H200_HOOK_PER_TENSOR_S + H200_HOOK_PER_CALL_S == pytest.approx(H200_EXPERT_HOOKED_S)
    assert ACCELERATE.per_pageable_byte == pytest.approx(82.4e-12, rel=1e-3)
    rate = 1 / (1 / hardware("h200").pageable_h2d + ACCELERATE.per_pageable_byte)
    assert 7.0e9 < rate < 8.0e9


def test_accelerate_copies_are_pageable_at_the_preset_rate() -> None:
    _, spans = accelerate_run(fused=0)
    copy = of(spans, Op.PAGE_COPY)[0].node
    hw = hardware("t4")
    assert copy.lane is Lane.GPU_H2D
    assert COST.transfer_seconds(copy.lane, copy.bytes, copy.pageable) == pytest.approx(
        copy.bytes / hw.pageable_h2d
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from tests.hf_models import hf_model, save_hf

    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("accelerate") / "mixtral"))


@pytest.mark.parametrize("empty_calls", [0, 1])
def test_one_module_per_expert_gives_eager_tokens(tiny_model, empty_calls: int) -> None:
    policy = Policy(
        micro_batch_size=3,
        micro_batches=2,
        weights_gpu_share=0.0,
        options=(AccelerateOptions(fused_experts=0, empty_calls=empty_calls),),
    )
    (results, _), _ = run_scheduler(tiny_model, "accelerate", policy, device="cpu")
    (reference, _) = run_eager(tiny_model)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]


def test_offload_dense_copies_each_offloaded_layers_dense_part_before_its_attention_and_frees_it_after() -> (
    None
):
    steps = [prefill(4, 256), decode(4, 256)]
    options = (AccelerateOptions(fused_experts=0, offload_dense=1),)
    sched = scheduler("accelerate", weights_gpu_share=1 / 3, options=options)
    spans = simulate(sched, steps, trace_of(steps, ROUTES), COST)
    dense = [c for c in of(spans, Op.PAGE_COPY) if c.node.expert < 0]
    offloaded = sorted({c.node.layer for c in of(spans, Op.PAGE_COPY) if c.node.expert >= 0})
    assert offloaded == [1, 2] and sorted(c.node.layer for c in dense) == [1, 1, 2, 2]  # once a layer a step
    assert all(c.node.pageable and c.node.sync and c.node.bytes == SPEC.layer_dense_bytes(1) for c in dense)
    assert sched.residency().dense == frozenset({0})
    assert sched.weight_buffer_bytes() == SPEC.layer_dense_bytes(1) + SPEC.expert_bytes
    ids = by_id(spans)
    evicts = sorted((s for s in of(spans, Op.EVICT) if s.node.expert < 0), key=lambda s: s.start)
    for copy, evict in zip(sorted(dense, key=lambda s: s.start), evicts, strict=True):
        assert evict.node.layer == copy.node.layer
        pres = [s for s in of(spans, Op.PRE_ATTN) if s.node.layer == copy.node.layer and copy.end <= s.start]
        assert len([p for p in pres if p.start <= evict.start]) == 2  # both micro-batches attend in between
        tails = [ids[d] for d in evict.node.deps]
        assert {t.node.op for t in tails} == {Op.COMBINE} and len(tails) == 2  # freed after both tails
    unchanged = scheduler(
        "accelerate", weights_gpu_share=1 / 3, options=(AccelerateOptions(fused_experts=0),)
    )
    assert unchanged.residency().dense == frozenset({0, 1, 2})


@pytest.mark.parametrize(("family", "share"), [("mixtral", 0.0), ("deepseek_v2_lite", 0.5)])
def test_offload_dense_gives_eager_tokens(
    family: str, share: float, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Mixtral with every layer offloaded; DeepSeek-V2-Lite's shape (MLA, shared experts, a dense first
    layer) with its first MoE layer kept: the dense first layer stays, the last layer's dense part moves."""
    from tests.hf_models import hf_model, save_hf

    model = load_model(save_hf(hf_model(family), tmp_path_factory.mktemp("dense") / family))
    policy = Policy(
        micro_batch_size=3,
        micro_batches=2,
        weights_gpu_share=share,
        options=(AccelerateOptions(fused_experts=0, offload_dense=1),),
    )
    (results, _), _ = run_scheduler(model, "accelerate", policy, device="cpu")
    (reference, _) = run_eager(model)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
