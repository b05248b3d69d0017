"""cgopipe, klotski, fiddler and lru-cache: the same tokens as eager with weights actually paged,
and each paper's signature on the virtual clock at paper-size shapes (Mixtral-8x7B, 4 layers, T4)."""

from __future__ import annotations

import itertools

import pytest
from attrs import evolve

from flowmoe.cli.run import routing_profile
from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.executor import Span
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import ExpertCounts, Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel, SyntheticRouting
from flowmoe.jobs.engine import eager_step
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers._correlation import CorrelationTable
from flowmoe.schedulers.klotski import KlotskiOptions
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.registry import create
from flowmoe.schedulers.shared_options import PagedOptions
from flowmoe.study.simulate import simulate
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import TINY_CONFIG, assert_as_eager, generate

T4 = RooflineCost(hardware("t4"))
MIXTRAL = preset("mixtral-8x7b", layers=4)


def scheduler(name: str, spec: ModelSpec, policy: Policy, **extra):
    return create(name, SchedulerContext(spec, policy, NodeFactory(spec), **extra))


def decode_step(micro_batches: int, sequences: int, context: int, step: int = 0) -> StepShape:
    shapes = (
        MicroBatchShape.from_lengths(i, [1] * sequences, [context] * sequences) for i in range(micro_batches)
    )
    return StepShape(step, False, tuple(shapes))


def uniform_trace(spec: ModelSpec, steps: list[StepShape]) -> RoutingTrace:
    """Every expert of every layer gets an equal share of each micro-batch's top-k choices."""
    trace, m = RoutingTrace(), spec.moe
    for step in steps:
        for layer in range(spec.layers):
            for mb in step.micro_batches:
                share = max(1, mb.tokens * m.top_k // m.experts)
                trace.record(
                    step.step, ExpertCounts(layer, mb.index, tuple((e, share) for e in range(m.experts)))
                )
    return trace


def spans_of(spans: list[Span], op: Op, layer: int | None = None, mb: int | None = None) -> list[Span]:
    return [
        s for s in spans
        if s.node.op is op and (layer is None or s.node.layer == layer) and (mb is None or s.node.mb == mb)
    ]  # fmt: skip


def window(spans: list[Span]) -> tuple[float, float]:
    return min(s.start for s in spans), max(s.end for s in spans)


# ---- real runs: the same tokens as eager with the weights paged, evicted and computed on the CPU


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = save_hf(hf_model(request.param), tmp_path_factory.mktemp("pipelines") / request.param)
    return load_model(folder)


@pytest.fixture(scope="module")
def reference(model):
    return generate(model, eager_step, micro_batches=3)


CHEAP_CPU = evolve(hardware("t4"), name="cheap-cpu", h2d_bandwidth=1e7, cpu_launch=1e-6)
MBS = {"micro_batch_size": 2, "micro_batches": 3}
OFFLOADED = {  # case -> scheduler, policy, hardware its latency model prices work on (None: default)
    "cgopipe": (
        "cgopipe",
        Policy(**MBS, attention_on="cpu", weights_gpu_share=0.25, options=(PagedOptions(page_bytes=4096),)),
        None,
    ),
    "cgopipe-chunks": (
        "cgopipe",
        Policy(**MBS, attention_on="cpu", weights_gpu_share=0.25, options=(PagedOptions(page_bytes=2**30),)),
        None,
    ),
    "cgopipe-gpu-attention": ("cgopipe", Policy(**MBS, weights_gpu_share=0.25, kv_gpu_share=0.0), None),
    "klotski": (
        "klotski",
        Policy(**MBS, weights_gpu_share=0.0, options=(KlotskiOptions(hot_experts=2),)),
        None,
    ),
    "fiddler-copies": ("fiddler", Policy(**MBS, weights_gpu_share=0.25), None),
    "fiddler-cpu": ("fiddler", Policy(**MBS, weights_gpu_share=0.25), CHEAP_CPU),
    "lru-cache": (
        "lru-cache",
        Policy(**MBS, options=(LRUCacheOptions(expert_cache_slots=4, cache_ways=2),)),
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(OFFLOADED))
def test_same_tokens_as_eager_with_weights_offloaded(model, reference, case: str) -> None:
    """Weights paged in under the declared buffer (the runtime enforces it), experts evicted,
    experts on the CPU: tokens and logits still those of eager."""
    name, policy, hw = OFFLOADED[case]
    runtime = Runtime.create(model, name, policy, cost=RooflineCost(hw) if hw else None)
    try:
        ours = generate(model, runtime, micro_batches=3)
    finally:
        runtime.close()
    assert_as_eager(ours, reference)
    lanes = {(s.node.op, s.node.lane) for s in runtime.trace.spans}
    assert (Op.PAGE_COPY, Lane.GPU_H2D) in lanes or case == "fiddler-cpu"
    assert ((Op.EXPERT_FFN, Lane.CPU_COMPUTE) in lanes) == (case in ("fiddler-cpu", "lru-cache"))


# ---- cgopipe: CPU attention two micro-batches ahead, the next layer's pages between hidden loads


def test_cgopipe_runs_cpu_attention_two_ahead_and_loads_each_hidden_state_before_its_weight_chunk() -> None:
    """Algorithm 1: LOADH(i, j) then W_PINTOG(i + 1, j) on h2d; PREATTN(i, j + 2) after POSTATTN(i, j) on
    the GPU, so the CPU attention of j + 2 runs while the GPU computes the FFN of j + 1."""
    policy = Policy(micro_batch_size=256, micro_batches=4, attention_on="cpu", weights_gpu_share=0.75)
    step = decode_step(4, 256, 512)
    spans = simulate(scheduler("cgopipe", MIXTRAL, policy), [step], uniform_trace(MIXTRAL, [step]), T4)
    for layer in range(1, MIXTRAL.layers):  # layer 0 fills the pipeline while its weights arrive
        for j in range(2):
            attn = window(spans_of(spans, Op.CPU_ATTN, layer, j + 2))
            assert window(spans_of(spans, Op.EXPERT_FFN, layer, j))[1] <= attn[0]
            ffn = window(spans_of(spans, Op.EXPERT_FFN, layer, j + 1))
            assert attn[0] < ffn[1] and ffn[0] < attn[1], (layer, j, attn, ffn)
    h2d = sorted((s for s in spans if s.node.lane is Lane.GPU_H2D), key=lambda s: s.start)
    pages_per_layer = 2 * -(-MIXTRAL.expert_bytes // PagedOptions().page_bytes)  # 2 of 8 experts paged
    for layer in range(1, MIXTRAL.layers):
        chunks: list[tuple[int, int]] = []  # (layer, mb) of the hidden load each chunk follows
        for before, item in itertools.pairwise(h2d):
            if item.node.op is Op.PAGE_COPY and item.node.layer == layer and before.node.op is Op.HIDDEN_LOAD:
                chunks.append((before.node.layer, before.node.mb))
                assert before.end <= item.start + 1e-12
        assert chunks == [(layer - 1, j) for j in range(4)]
        copies = spans_of(spans, Op.PAGE_COPY, layer)  # each chunk's pages of one expert: one node
        assert sum(s.node.pages for s in copies) == pages_per_layer and len(copies) == 4
    assert not spans_of(spans, Op.GPU_ATTN) and len(spans_of(spans, Op.CPU_ATTN)) == 16


def test_cgopipe_pages_of_several_experts_make_one_copy_per_chunk() -> None:
    """Pages of 4 experts, 8 experts paged per layer in 4 chunks (one per micro-batch): each chunk of 2
    experts is one PAGE_COPY; every expert's FFN waits for the copy that brought it."""
    pages = PagedOptions(page_bytes=4 * MIXTRAL.expert_bytes)
    policy = Policy(micro_batch_size=64, micro_batches=4, weights_gpu_share=0.0, options=(pages,))
    step = decode_step(4, 64, 512)
    spans = simulate(scheduler("cgopipe", MIXTRAL, policy), [step], uniform_trace(MIXTRAL, [step]), T4)
    ids = {s.node.id: s for s in spans}
    for layer in range(MIXTRAL.layers):
        copies = spans_of(spans, Op.PAGE_COPY, layer)
        assert sorted(e for c in copies for e in c.node.experts) == list(range(8))
        if layer == 0:  # before the first slot: one chunk, in two full pages
            assert [len(c.node.experts) for c in copies] == [4, 4]
        else:
            assert len(copies) == 4 and all(c.node.bytes == 2 * MIXTRAL.expert_bytes for c in copies)
        for ffn in spans_of(spans, Op.EXPERT_FFN, layer):
            (copy,) = [ids[d] for d in ffn.node.deps if ids[d].node.op is Op.PAGE_COPY]
            assert ffn.node.expert in copy.node.experts and copy.end <= ffn.start + 1e-12


def test_cgopipe_stages_pageable_weights_on_the_cpu_after_each_slots_attention() -> None:
    """Algorithm 1 with weights not pinned: W_CTOPIN(i + 1, j) on cpu.stage after CPUATTN(i, j), and each
    page's W_PINTOG after its staging copy; with pinned weights there is no staging at all."""
    pages = PagedOptions(page_bytes=2**30)
    policy = Policy(
        micro_batch_size=64, micro_batches=4, attention_on="cpu", weights_gpu_share=0.5, options=(pages,)
    )
    step = decode_step(4, 64, 512)
    pinned = simulate(scheduler("cgopipe", MIXTRAL, policy), [step], uniform_trace(MIXTRAL, [step]), T4)
    assert not spans_of(pinned, Op.W_STAGE)
    sched = scheduler("cgopipe", MIXTRAL, policy, cost=T4, weights_pinned=False)
    spans = simulate(sched, [step], uniform_trace(MIXTRAL, [step]), T4)
    ids = {s.node.id: s for s in spans}
    for copy in spans_of(spans, Op.PAGE_COPY):
        (stage,) = [ids[d] for d in copy.node.deps if ids[d].node.op is Op.W_STAGE]
        assert stage.node.lane is Lane.CPU_STAGE and stage.node.experts == copy.node.experts
        assert stage.node.bytes == 2 * copy.node.bytes and stage.end <= copy.start + 1e-12
    for layer in range(MIXTRAL.layers - 1):
        cpu = [s.node for s in sorted(spans, key=lambda s: s.node.id) if s.node.lane.device == "cpu"]
        for j in range(4):
            at = cpu.index(next(n for n in cpu if n.op is Op.CPU_ATTN and (n.layer, n.mb) == (layer, j)))
            assert cpu[at + 1].op is Op.W_STAGE and cpu[at + 1].layer == layer + 1


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_cgopipe_with_gpu_attention_loads_the_cpu_share_of_each_cache_layer(share: float) -> None:
    """The HRM policy's other attention placement: GPU attention, the cache layer of each micro-batch
    loaded (but the `kv_gpu_share` the GPU keeps) ahead of the chunk of weights issued with it."""
    policy = Policy(micro_batch_size=64, micro_batches=4, weights_gpu_share=0.5, kv_gpu_share=share)
    step = decode_step(4, 64, 512)
    sched = scheduler("cgopipe", MIXTRAL, policy)
    spans = simulate(sched, [step], uniform_trace(MIXTRAL, [step]), T4)
    assert not spans_of(spans, Op.CPU_ATTN) and len(spans_of(spans, Op.GPU_ATTN)) == 16
    loads = spans_of(spans, Op.KV_LOAD)
    assert sched.kv_on_gpu() == (share == 1.0) and len(loads) == (0 if share == 1.0 else 16)
    full = NodeFactory(MIXTRAL).node(Op.KV_LOAD, Lane.GPU_H2D, 0, step.micro_batches[0]).bytes
    assert all(s.node.bytes == round(full * (1 - share)) for s in loads)


def test_cgopipe_prefills_on_the_gpu_with_the_kv_cache_sent_to_the_cpu() -> None:
    policy = Policy(micro_batch_size=4, micro_batches=2, attention_on="cpu", weights_gpu_share=0.5)
    prompt = tuple(MicroBatchShape.from_lengths(i, [64] * 4, [0] * 4) for i in range(2))
    step = StepShape(0, True, prompt)
    spans = simulate(scheduler("cgopipe", MIXTRAL, policy), [step], uniform_trace(MIXTRAL, [step]), T4)
    assert not spans_of(spans, Op.CPU_ATTN) and len(spans_of(spans, Op.GPU_ATTN)) == 8
    assert len(spans_of(spans, Op.KV_STORE)) == 8
    assert all(s.node.bytes == 0 for s in spans_of(spans, Op.KV_LOAD))  # nothing cached before a prefill


# ---- klotski: hot experts prefetched before the gate and computed first, the planner's n


def shifting_trace(spec: ModelSpec, step: StepShape) -> RoutingTrace:
    """Micro-batch j at layer l routes to experts l+j, l+j+1, l+j+2 (mod E): each layer's group
    needs 6 of 8 experts, more than the K hot ones."""
    trace, tokens = RoutingTrace(), step.micro_batches[0].tokens
    for layer in range(spec.layers):
        for mb in step.micro_batches:
            experts = sorted((layer + mb.index + i) % spec.moe.experts for i in range(3))
            trace.record(
                step.step, ExpertCounts(layer, mb.index, tuple((e, tokens * 2 // 3) for e in experts))
            )
    return trace


def test_klotski_prefetches_hot_experts_before_the_gate_and_computes_them_first() -> None:
    """A routing profile seeds the correlation table: hot experts of layer l are l+2 and l+3."""
    policy = Policy(64, 4, weights_gpu_share=0.0, options=(KlotskiOptions(group_size=4),))
    step = decode_step(4, 64, 512)
    trace = shifting_trace(MIXTRAL, step)
    profile = tuple(
        tuple(sum(trace.counts[(0, layer, mb)].tokens(e) for mb in range(4)) / 512 for e in range(8))
        for layer in range(MIXTRAL.layers)
    )
    klotski = scheduler("klotski", MIXTRAL, policy, popularity=profile)
    spans = simulate(klotski, [step], trace, T4)
    for layer in range(MIXTRAL.layers):
        gates = spans_of(spans, Op.GATE, layer)
        copies = [s for s in spans_of(spans, Op.PAGE_COPY, layer) if s.node.expert >= 0]
        hot = {s.node.expert for s in copies if s.queued < min(g.start for g in gates)}
        cold = [s for s in copies if s.node.expert not in hot]
        assert hot == {(layer + 2) % 8, (layer + 3) % 8} and cold
        assert all(s.queued >= min(g.end for g in gates) for s in cold)  # issued after a gate
        ffns = spans_of(spans, Op.EXPERT_FFN, layer)
        hot_ffns = [s.start for s in ffns if s.node.expert in hot]
        cold_ffns = [s.start for s in ffns if s.node.expert not in hot]
        assert hot_ffns and max(hot_ffns) < min(cold_ffns), layer
        assert len({s.node.mb for s in ffns}) == 4  # the whole group in one layer pass
        assert len(spans_of(spans, Op.EVICT, layer)) == len(copies) + 1  # and the dense part


def test_klotski_learns_which_experts_follow_which() -> None:
    """Layer l always routes to the same pair; after a warm-up step the prefetched hot experts
    of every layer are exactly that pair, so nothing is copied after a gate any more."""
    pairs = {0: (5, 6), 1: (2, 7), 2: (3, 4), 3: (1, 6)}
    steps = [decode_step(2, 8, 64, step=s) for s in range(2)]
    trace = RoutingTrace()
    for step in steps:
        for layer, pair in pairs.items():
            for mb in range(2):
                trace.record(step.step, ExpertCounts(layer, mb, tuple((e, 8) for e in pair)))
    policy = Policy(8, 2, weights_gpu_share=0.0, options=(KlotskiOptions(group_size=2),))
    spans = simulate(scheduler("klotski", MIXTRAL, policy), steps, trace, T4)
    second = [s for s in spans if s.start >= max(s.end for s in spans_of(spans, Op.LM_HEAD)[:2])]
    for layer, pair in pairs.items():
        gate = min(s.start for s in spans_of(second, Op.GATE, layer))
        copies = [s for s in spans_of(second, Op.PAGE_COPY, layer) if s.node.expert >= 0]
        assert sorted(s.node.expert for s in copies) == list(pair)
        assert all(s.queued < gate for s in copies)


def test_klotski_correlation_table_follows_per_token_paths() -> None:
    """One micro-batch whose tokens go 0 -> 4 and 1 -> 5 (layer 0 -> 1): with the per-token paths the
    table learns exactly that; from the counts alone every pair looks equally likely."""
    table = CorrelationTable.seeded([0, 1], 8, None)
    blind = CorrelationTable.seeded([0, 1], 8, None)
    first = ExpertCounts(0, 0, ((0, 4), (1, 4)))
    second = ExpertCounts(1, 0, ((4, 4), (5, 4)), follows=((0, 4, 4), (1, 5, 4)))
    table.learn([first], [second])
    blind.learn([first], [ExpertCounts(1, 0, second.counts)])
    later = [ExpertCounts(0, 0, ((0, 3), (2, 1)))]  # mostly expert 0 at layer 0 now
    assert table.hot(1, later, 1, range(8)) == [4]
    assert blind.hot(1, later, 2, range(8)) == [4, 5]
    synthetic = SyntheticRouting(MIXTRAL, RoutingModel(correlation=1.0)).trace([decode_step(1, 4, 8)])
    assert synthetic.counts[(0, 1, 0)].follows and not synthetic.counts[(0, 0, 0)].follows


@pytest.mark.parametrize(("h2d", "expected"), [(1e12, 1), (400e9, 3), (200e9, 8), (12e9, 8)])
def test_klotski_planner_picks_the_smallest_group_that_meets_its_constraints(
    h2d: float, expected: int
) -> None:
    """Mixtral decode, 64 sequences per micro-batch on a T4 roofline: a batch's attention and gate take
    0.737 ms, an expert's FFN over the group 1.112 ms; K = 2 hot experts, |Q| ~ 6 cold ones. One expert
    copies in 0.36 ms at 1 TB/s (every equation holds at n = 1); 0.885 ms at 400 GB/s: Eq. (5)
    n x 0.737 >= 2 x 0.885 -> n = 3; 1.77 ms at 200 GB/s: Eq. (5) alone gives 5, but Eq. (7) (all 8
    experts and the next layer's 84 MB of attention weights, 0.42 ms, before the next attention)
    n x 0.737 + 8 x 1.112 >= 8 x 1.77 + 0.42 needs n = 8; 29.4 ms at 12 GB/s: no n <= 8, so all 8."""
    ideal = evolve(hardware("t4"), gpu_memory_efficiency=1.0, gemm_efficiency=())  # the datasheet roofline
    cost = RooflineCost(evolve(ideal, h2d_bandwidth=h2d))
    policy = Policy(64, 8, weights_gpu_share=0.0, options=(KlotskiOptions(hot_experts=2),))
    step = decode_step(8, 64, 512)
    assert scheduler("klotski", MIXTRAL, policy, cost=cost).group_size(step) == expected
    three = policy.with_options(KlotskiOptions(hot_experts=2, group_size=3))
    assert scheduler("klotski", MIXTRAL, three, cost=cost).group_size(step) == 3


def test_klotski_loads_the_next_batch_cache_while_this_one_computes_and_pages_attention_weights() -> None:
    """Algorithm 1 lines 13-17: the KV cache of micro-batch j + 1 crosses h2d while j computes, the
    cache's home is the CPU (this step's k, v stored back), and each layer's attention weights come
    in during the layer before and leave after it."""
    policy = Policy(64, 4, weights_gpu_share=0.0, kv_gpu_share=0.0, options=(KlotskiOptions(group_size=4),))
    step = decode_step(4, 64, 2048)
    klotski = scheduler("klotski", MIXTRAL, policy, cost=T4)
    spans = simulate(klotski, [step], shifting_trace(MIXTRAL, step), T4)
    assert not klotski.kv_on_gpu() and klotski.residency().dense == frozenset()
    for layer in range(MIXTRAL.layers):
        for j in range(3):
            load = spans_of(spans, Op.KV_LOAD, layer, j + 1)[0]
            busy = [
                s
                for s in spans
                if s.node.lane is Lane.GPU_COMPUTE and (s.node.layer, s.node.mb) == (layer, j)
            ]
            assert any(s.start < load.end and load.start < s.end for s in busy), (layer, j)
        assert len(spans_of(spans, Op.KV_STORE, layer)) == 4
        (dense,) = [s for s in spans_of(spans, Op.PAGE_COPY, layer) if s.node.expert < 0]
        first = min(s.start for s in spans_of(spans, Op.PRE_ATTN, layer))
        assert dense.end <= first + 1e-12
        if layer >= 1:
            assert dense.start < max(s.end for s in spans_of(spans, Op.EXPERT_FFN, layer - 1))
    assert {s.node.layer for s in spans_of(spans, Op.EVICT) if s.node.expert < 0} == set(
        range(MIXTRAL.layers)
    )


def test_klotski_holds_two_layers_of_attention_weights_across_groups() -> None:
    """Four groups of one micro-batch each pass through every layer: a layer's dense copy waits for
    the eviction that frees its buffer, so at most two layers' dense parts are ever on the GPU."""
    policy = Policy(16, 4, weights_gpu_share=0.0, options=(KlotskiOptions(group_size=1),))
    step = decode_step(4, 16, 256)
    spans = simulate(
        scheduler("klotski", MIXTRAL, policy, cost=T4), [step], shifting_trace(MIXTRAL, step), T4
    )
    events = [(s.start, 1) for s in spans_of(spans, Op.PAGE_COPY) if s.node.expert < 0]
    events += [(s.end, -1) for s in spans_of(spans, Op.EVICT) if s.node.expert < 0]
    held = peak = 0
    for _, change in sorted(events):  # an eviction and a copy at the same instant: the eviction first
        held += change
        peak = max(peak, held)
    assert len(events) == 2 * 4 * MIXTRAL.layers and peak == 2
    ids = {s.node.id: s.node for s in spans}
    copies = sorted((s.node for s in spans_of(spans, Op.PAGE_COPY) if s.node.expert < 0), key=lambda n: n.id)
    for copy in copies[2:]:  # every copy but the first two waits for a dense eviction
        assert any(ids[d].op is Op.EVICT and ids[d].expert < 0 for d in copy.deps), copy.label


def test_klotski_reads_the_layers_host_memory_cannot_hold_from_disk() -> None:
    """§6.1's disk tier: host memory for 3.5 of the 4 layers' offloaded weights keeps layer 0 and two
    buffers of disk layers, so layers 1-3 are read from disk every pass (a layer ahead, on disk.read),
    and each of their copies to the GPU waits for the read."""
    policy = Policy(16, 2, weights_gpu_share=0.0, options=(KlotskiOptions(group_size=1),))
    layer = MIXTRAL.layer_dense_bytes(0) + MIXTRAL.layer_expert_bytes(0)
    host = 4 * layer - layer // 2
    step = decode_step(2, 16, 256)
    klotski = scheduler("klotski", MIXTRAL, policy, cost=T4, host_weight_bytes=host)
    assert klotski.disk_tier() and klotski.on_disk == {1, 2, 3}
    spans = simulate(klotski, [step], shifting_trace(MIXTRAL, step), T4)
    reads = spans_of(spans, Op.DISK_LOAD)
    assert [(s.node.layer, s.node.lane) for s in reads] == [(n, Lane.DISK_READ) for n in (1, 2, 3)] * 2
    ids = {s.node.id: s for s in spans}
    for copy in spans_of(spans, Op.PAGE_COPY):
        read = [ids[d] for d in copy.node.deps if ids[d].node.op is Op.DISK_LOAD]
        assert (copy.node.layer >= 1) == bool(read)
        assert all(r.node.layer == copy.node.layer and r.end <= copy.start + 1e-12 for r in read)
    assert not scheduler("klotski", MIXTRAL, policy, cost=T4).disk_tier()
    assert not scheduler("klotski", MIXTRAL, policy, cost=T4, host_weight_bytes=layer).disk_tier()


def test_klotski_refuses_cpu_placements() -> None:
    with pytest.raises(ConfigError, match=r"^scheduler klotski does not support --attention-on cpu "):
        scheduler("klotski", MIXTRAL, Policy(attention_on="cpu"))


# ---- fiddler: popular experts on the GPU, the others where the latency model says


SKEWED = tuple((0.4, 0.3, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03) for _ in range(MIXTRAL.layers))
FAST_CPU = evolve(hardware("t4"), name="fast-cpu", cpu_flops=10e12, cpu_bandwidth=200e9, h2d_bandwidth=2e9)
SLOW_CPU = evolve(hardware("t4"), name="slow-cpu", cpu_flops=0.2e12, cpu_bandwidth=5e9, h2d_bandwidth=64e9)


@pytest.mark.parametrize(("hw", "rare_lane"), [(FAST_CPU, Lane.CPU_COMPUTE), (SLOW_CPU, Lane.GPU_COMPUTE)])
def test_fiddler_places_popular_experts_and_prices_the_rest(hw, rare_lane: Lane) -> None:
    cost = RooflineCost(hw)
    policy = Policy(micro_batch_size=8, micro_batches=2, weights_gpu_share=0.25)
    fiddler = scheduler("fiddler", MIXTRAL, policy, cost=cost, popularity=SKEWED)
    assert fiddler.residency().experts == {(layer, e) for layer in range(MIXTRAL.layers) for e in (0, 1)}
    step = decode_step(2, 8, 256)
    spans = simulate(fiddler, [step], uniform_trace(MIXTRAL, [step]), cost)
    ffns = spans_of(spans, Op.EXPERT_FFN)
    assert {s.node.lane for s in ffns if s.node.expert in (0, 1)} == {Lane.GPU_COMPUTE}
    assert {s.node.lane for s in ffns if s.node.expert >= 2} == {rare_lane}
    copied = {(s.node.layer, s.node.expert) for s in spans_of(spans, Op.PAGE_COPY)}
    rare = {(layer, e) for layer in range(MIXTRAL.layers) for e in range(2, 8)}
    assert copied == (rare if rare_lane is Lane.GPU_COMPUTE else set())


def test_fiddler_latency_model_sends_big_token_counts_to_the_gpu() -> None:
    """Even where the CPU wins for a decode step, enough tokens make copy + GPU the faster path."""
    fiddler = scheduler("fiddler", MIXTRAL, Policy(weights_gpu_share=0.25), cost=RooflineCost(FAST_CPU))
    assert fiddler.threshold is not None
    assert fiddler.on_cpu(fiddler.threshold - 1) and not fiddler.on_cpu(fiddler.threshold)
    assert 16 < fiddler.threshold < 100_000


def test_fiddler_with_ffn_on_cpu_never_copies_an_expert() -> None:
    policy = Policy(micro_batch_size=64, micro_batches=2, weights_gpu_share=0.25, ffn_on="cpu")
    fiddler = scheduler("fiddler", MIXTRAL, policy, cost=T4, popularity=SKEWED)
    step = decode_step(2, 64, 128)
    spans = simulate(fiddler, [step], uniform_trace(MIXTRAL, [step]), T4)
    assert not spans_of(spans, Op.PAGE_COPY) and fiddler.weight_buffer_bytes() == 0
    on_cpu = {
        (s.node.layer, s.node.expert)
        for s in spans_of(spans, Op.EXPERT_FFN)
        if s.node.lane is Lane.CPU_COMPUTE
    }
    assert on_cpu and not on_cpu & fiddler.residency().experts
    with pytest.raises(ConfigError, match=r"^scheduler fiddler does not support --attention-on cpu "):
        scheduler("fiddler", MIXTRAL, Policy(attention_on="cpu"), cost=T4)


def test_fiddler_places_the_experts_a_recorded_routing_trace_made_popular(model, reference, tmp_path) -> None:
    """`flowmoe run --routing-profile`: the gates' counts recorded in one run place the experts of the
    next; the tokens stay eager's."""
    recorder = Runtime.create(model, "eager", Policy(**MBS))
    recorder.routing = RoutingTrace.for_model(model.spec)
    try:
        generate(model, recorder, micro_batches=3)
    finally:
        recorder.close()
    recorder.routing.save(tmp_path / "routing.jsonl")
    profile = routing_profile(tmp_path / "routing.jsonl", model)
    runtime = Runtime.create(model, "fiddler", Policy(**MBS, weights_gpu_share=0.25), popularity=profile)
    try:
        results, _ = generate(model, runtime, micro_batches=3)
    finally:
        runtime.close()
    assert [r.output_ids for r in results] == [r.output_ids for r in reference[0]]
    resident = runtime.scheduler.residency().experts
    rest = {(layer, e) for layer, row in enumerate(profile) for e in range(len(row))} - resident
    share = {(layer, e): row[e] for layer, row in enumerate(profile) for e in range(len(row))}
    assert resident and min(share[k] for k in resident) >= max(share[k] for k in rest)


# ---- lru-cache: an N-index x M-way cache by layer, misses on the CPU, fetched behind


def test_lru_cache_gives_each_of_the_first_n_layers_its_own_lru_set() -> None:
    """4 slots, 2 ways -> 2 indexes: layer 0 and layer 1 each own 2 ways (LRU within the layer).

    step 0  L0 mb0 {0,2}: miss, miss                 L0 [0 2]
            L0 mb1 {0,1}: hit, miss (evict L0e2)     L0 [0 1]
            L1 mb0 {1,3}: miss, miss                 L1 [1 3]
            L1 mb1 {1,3}: hit, hit                   L1 [1 3]
    step 1  L0 mb0 {0,1}: hit, hit                   L0 [0 1]
            L0 mb1 {0,2}: hit, miss (evict L0e1)     L0 [0 2]
            L1 mb0 {1,3}: hit, hit                   L1 [1 3]
            L1 mb1 {0,3}: miss (evict L1e1), hit     L1 [0 3]
    -> 9 hits, 7 misses; evictions L0e2, L0e1, L1e1."""
    routes = {
        (0, 0, 0): (0, 2), (0, 0, 1): (0, 1), (0, 1, 0): (1, 3), (0, 1, 1): (1, 3),
        (1, 0, 0): (0, 1), (1, 0, 1): (0, 2), (1, 1, 0): (1, 3), (1, 1, 1): (0, 3),
    }  # fmt: skip
    trace = RoutingTrace()
    for (step, layer, mb), experts in routes.items():
        trace.record(step, ExpertCounts(layer, mb, tuple((e, 2) for e in experts)))
    spec = ModelSpec.from_hf(TINY_CONFIG)
    options = LRUCacheOptions(expert_cache_slots=4, cache_ways=2)
    cache = scheduler("lru-cache", spec, Policy(micro_batch_size=2, micro_batches=2, options=(options,)))
    spans = simulate(cache, [decode_step(2, 2, 4, step=s) for s in range(2)], trace, T4)
    assert cache.report() == {"hits": 9.0, "misses": 7.0, "hit_rate": 9 / 16, "expert_cache_slots": 4.0}
    ffns = spans_of(spans, Op.EXPERT_FFN)
    assert sum(s.node.lane is Lane.CPU_COMPUTE for s in ffns) == 7
    assert sum(s.node.lane is Lane.GPU_COMPUTE for s in ffns) == 9
    assert len(spans_of(spans, Op.PAGE_COPY)) == 7
    evicted = [
        (s.node.layer, s.node.expert) for s in sorted(spans_of(spans, Op.EVICT), key=lambda s: s.node.id)
    ]
    assert evicted == [(0, 2), (0, 1), (1, 1)]


def test_lru_cache_layers_past_the_indexes_never_copy_and_outputs_do_not_queue_behind_fetches() -> None:
    """Mixtral, 4 layers, batch 1: 8 slots in 4 ways cover layers 0 and 1; layers 2 and 3 compute
    every expert on the CPU and never copy one. A CPU expert's output (EXPERT_LOAD) waits on the
    h2d lane for at most one page of a background fetch, never for whole experts."""
    steps = [decode_step(1, 1, 128, step=s) for s in range(3)]
    trace, m = RoutingTrace(), MIXTRAL.moe
    for step in steps:
        for layer in range(MIXTRAL.layers):
            chosen = ((layer + step.step) % m.experts, (layer + 3 * step.step + 1) % m.experts)
            trace.record(step.step, ExpertCounts(layer, 0, tuple((e, 1) for e in sorted(chosen))))
    options = LRUCacheOptions(page_bytes=64 * 2**20, expert_cache_slots=8, cache_ways=4)
    policy = Policy(micro_batch_size=1, options=(options,))
    cache = scheduler("lru-cache", MIXTRAL, policy, cost=T4)
    spans = simulate(cache, steps, trace, T4)
    copies = spans_of(spans, Op.PAGE_COPY)
    assert copies and {s.node.layer for s in copies} == {0, 1}
    for layer in (2, 3):
        assert all(s.node.lane is Lane.CPU_COMPUTE for s in spans_of(spans, Op.EXPERT_FFN, layer))
    assert cache.hits > 0
    ends = {s.node.id: s.end for s in spans}
    page = max(s.end - s.start for s in copies)
    for load in spans_of(spans, Op.EXPERT_LOAD):
        ready = max(ends[d] for d in load.node.deps)
        assert load.start - ready <= page + 1e-9, load.node.label
    whole = -(-MIXTRAL.expert_bytes // options.page_bytes)
    assert whole > 1 and all(s.node.parts == whole for s in copies)


def test_synthetic_routing_reuses_experts_token_to_token_and_the_cache_sees_it() -> None:
    """Batch-1 decode on Mixtral, uniform popularity: with the default reuse a selected expert is
    re-employed by the next token 30-50% of the time (the collaborative-inference paper's Fig. 2),
    by chance alone about 2/8; the LRU cache hits more often than without temporal locality."""
    steps = [decode_step(1, 1, 64 + s, step=s) for s in range(24)]
    rates = {}
    for reuse in (0.0, RoutingModel().reuse):
        trace = SyntheticRouting(MIXTRAL, RoutingModel(skew=0.0, reuse=reuse)).trace(steps)
        kept = [
            len(set(trace.counts[(s, layer, 0)].experts) & set(trace.counts[(s - 1, layer, 0)].experts))
            for s in range(1, len(steps))
            for layer in range(MIXTRAL.layers)
        ]
        options = LRUCacheOptions(expert_cache_slots=16, cache_ways=4)
        cache = scheduler("lru-cache", MIXTRAL, Policy(micro_batch_size=1, options=(options,)))
        simulate(cache, steps, trace, T4)
        rates[reuse] = (sum(kept) / (2 * len(kept)), cache.report()["hit_rate"])
    default = RoutingModel().reuse
    assert rates[0.0][0] < 0.3 < rates[default][0] < 0.5
    assert rates[default][1] > rates[0.0][1]


def test_lru_cache_refuses_placements_its_paper_does_not_have() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)
    for flag, policy in (
        ("--attention-on cpu", Policy(attention_on="cpu")),
        ("--ffn-on cpu", Policy(ffn_on="cpu")),
    ):
        with pytest.raises(ConfigError, match=f"scheduler lru-cache does not support {flag}"):
            scheduler("lru-cache", spec, policy)
