"""klotski's Algorithm 1 barriers and copies on the virtual clock (Mixtral-8x7B, 4 layers, T4), and its
correlation table's choice of hot experts as Klotski's code makes it."""

from __future__ import annotations

from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.memory import gpu_memory
from flowmoe.core.plan import ExpertCounts, Op
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import StepShape
from flowmoe.schedulers._correlation import CorrelationTable
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.study.simulate import simulate
from tests.helpers import rectangle
from tests.test_sched_pipelines import MIXTRAL, T4, decode_step, scheduler, shifting_trace, spans_of

EPS = 1e-12


FAST = RooflineCost(evolve(hardware("t4"), h2d_bandwidth=1e13))  # a link that would run ahead


def same_trace(step: StepShape) -> RoutingTrace:
    """Every micro-batch at layer l routes to experts l, l+1, l+2 (mod E)."""
    trace, tokens = RoutingTrace(), step.micro_batches[0].tokens
    for layer in range(MIXTRAL.layers):
        experts = sorted((layer + i) % MIXTRAL.moe.experts for i in range(3))
        for mb in step.micro_batches:
            trace.record(
                step.step, ExpertCounts(layer, mb.index, tuple((e, tokens * 2 // 3) for e in experts))
            )
    return trace


def run(policy: Policy, pinned: bool = True, cost: RooflineCost = T4, same: bool = False):
    step = decode_step(policy.micro_batches, policy.micro_batch_size, 512)
    klotski = scheduler("klotski", MIXTRAL, policy, cost=cost, weights_pinned=pinned)
    return simulate(klotski, [step], same_trace(step) if same else shifting_trace(MIXTRAL, step), cost)


def test_klotski_gates_wait_for_the_hot_experts_and_the_next_layer_for_this_one() -> None:
    """Line 18's sync(load_weight_stream) ends the attention layer: no gate starts before the layer's
    hot experts are in. The host issues the next layer's loads only when it gets there: the hot
    experts and the caches of batches 1.. of layer l wait for layer l - 1 to end, the attention
    weights of layer l + 1 (and its first batch's cache) for layer l's last gate, even over a link
    that would run ahead and with every batch routed to the same experts (no cold copy after the
    first gate holds the link back)."""
    policy = Policy(16, 4, weights_gpu_share=0.0, kv_gpu_share=0.0, options=(KlotskiOptions(group_size=4),))
    spans = run(policy, cost=FAST, same=True)
    dense_evict = {s.node.layer: s for s in spans_of(spans, Op.EVICT) if s.node.expert < 0}
    for layer in range(MIXTRAL.layers):
        gates = spans_of(spans, Op.GATE, layer)
        first_gate = min(g.start for g in gates)
        hot = [
            s for s in spans_of(spans, Op.PAGE_COPY, layer) if s.node.expert >= 0 and s.queued < first_gate
        ]
        assert len(hot) == 2 and all(s.end <= first_gate + EPS for s in hot)
        if layer >= 1:
            end = dense_evict[layer - 1].end
            assert all(s.start >= end - EPS for s in hot)
            loads = [s for s in spans_of(spans, Op.KV_LOAD, layer) if s.node.mb >= 1]
            assert len(loads) == 3 and all(s.start >= end - EPS for s in loads)
        if layer + 1 < MIXTRAL.layers:
            last_gate = max(g.end for g in gates)
            (dense,) = [s for s in spans_of(spans, Op.PAGE_COPY, layer + 1) if s.node.expert < 0]
            first_kv = [s for s in spans_of(spans, Op.KV_LOAD, layer + 1) if s.node.mb == 0]
            assert dense.start >= last_gate - EPS and first_kv[0].start >= last_gate - EPS


def test_klotski_prefetching_every_expert_is_the_strawman_layer_by_layer_pipeline() -> None:
    """K = E (the ablation's '+ Multi batches', Fig. 4(b)): the whole MoE layer loads during the
    attention and every gate waits for all of it, so nothing is copied after a gate; with hot
    experts only the GPU computes the group's hot experts while the cold ones cross the link, and
    the run ends sooner. Either way the next layer's experts come in only after this layer's left."""
    policy = Policy(16, 4, weights_gpu_share=0.0, kv_gpu_share=0.0, options=(KlotskiOptions(group_size=4),))
    strawman = run(policy.with_options(KlotskiOptions(hot_experts=8, group_size=4)))
    for layer in range(MIXTRAL.layers):
        first_gate = min(g.start for g in spans_of(strawman, Op.GATE, layer))
        copies = [s for s in spans_of(strawman, Op.PAGE_COPY, layer) if s.node.expert >= 0]
        assert len(copies) == 8 and all(s.end <= first_gate + EPS for s in copies)
    klotski = run(policy)
    assert max(s.end for s in klotski) < max(s.end for s in strawman)
    for spans in (strawman, klotski):  # the expert buffer: one layer's offloaded experts
        events = [(s.start, 1) for s in spans_of(spans, Op.PAGE_COPY) if s.node.expert >= 0]
        events += [(s.end, -1) for s in spans_of(spans, Op.EVICT) if s.node.expert >= 0]
        held = peak = 0
        for _, change in sorted(events):  # an eviction and a copy at the same instant: the eviction first
            held += change
            peak = max(peak, held)
        assert held == 0 and peak <= MIXTRAL.moe.experts


def test_klotski_cache_copies_are_pageable_and_weight_copies_unless_pinned() -> None:
    """Klotski's CPU cache is FlexGen's, allocated unpinned; its CPU weights are pinned only where host
    memory suffices (§6.1), else their copies are pageable too."""
    policy = Policy(16, 2, weights_gpu_share=0.0, kv_gpu_share=0.0, options=(KlotskiOptions(group_size=2),))
    for pinned in (True, False):
        spans = run(policy, pinned)
        kv = spans_of(spans, Op.KV_LOAD) + spans_of(spans, Op.KV_STORE)
        assert kv and all(s.node.pageable for s in kv)
        copies = spans_of(spans, Op.PAGE_COPY)
        assert copies and all(s.node.pageable is not pinned for s in copies)


def test_klotski_keeps_the_caches_of_the_first_layers_on_the_gpu() -> None:
    """`kv_gpu_share` 0.5 of 4 layers: layers 0 and 1 keep their caches on the GPU (their copies move
    nothing), as Klotski's code places caches layer by layer, and the GPU memory holds them."""
    policy = Policy(16, 2, weights_gpu_share=0.0, kv_gpu_share=0.5, options=(KlotskiOptions(group_size=2),))
    spans = run(policy)
    for s in spans_of(spans, Op.KV_LOAD) + spans_of(spans, Op.KV_STORE):
        assert (s.node.bytes == 0) == (s.node.layer < 2), s.node.label
    batch = rectangle(32, 512, micro_batch=16, gen=1)  # the memory figure counts the GPU-kept layers once
    whole = 32 * 512 * MIXTRAL.kv_bytes_per_token
    working = 2 * 16 * 511 * MIXTRAL.kv_bytes_per_token // MIXTRAL.layers  # two micro-batches' slices
    klotski = scheduler("klotski", MIXTRAL, policy)
    assert gpu_memory(klotski, batch).kv_cache == 2 * whole // MIXTRAL.layers + working
    assert (
        gpu_memory(scheduler("klotski", MIXTRAL, evolve(policy, kv_gpu_share=0.0)), batch).kv_cache == working
    )


def test_klotski_hot_experts_are_the_most_counted_top_k_followers() -> None:
    """Klotski's code credits each previous expert's tokens to its top-k followers, whatever their
    share: expert 3 follows both 0 and 1 almost as often as their top two do, yet is in neither
    top two, so it is not hot (a share-weighted sum would pick it)."""
    table = CorrelationTable.seeded([0, 1], 8, None, follow=2)
    first = ExpertCounts(0, 0, ((0, 10), (1, 10)))
    follows = ((0, 1, 50), (0, 2, 50), (0, 3, 49), (1, 4, 50), (1, 5, 50), (1, 3, 49))
    table.learn([first], [ExpertCounts(1, 0, ((1, 50), (2, 50), (3, 98), (4, 50), (5, 50)), follows)])
    assert table.hot(1, [first], 1, range(8)) == [1]
    assert table.hot(1, [first], 4, range(8)) == [1, 2, 4, 5]
    assert table.hot(1, [first], 2, [3, 6, 7]) == [3, 6]  # only those among the candidates
