"""on-demand, prefetch-all, flexgen, pre-gated and accelerate: each one's signature on the virtual
clock, and its GPU memory declaration checked both ways (too small a budget fails up front; the
declared weight buffer is what a real run fills, not a byte less).

The timelines are simulated (`flowmoe.study.simulate.simulate`) on Mixtral-8x7B cut to 3 layers with the
T4 roofline, routed by hand-written traces, so every assertion is about the order and overlap the
schedule produces, never about wall-clock time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import FlowmoeError, MemoryBudgetError
from flowmoe.core.executor import Span
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import ExpertCounts, Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import create
from flowmoe.study.simulate import simulate
from tests.helpers import rectangle
from tests.schedule_fixtures import generate

MINE = ("on-demand", "prefetch-all", "flexgen", "pre-gated", "accelerate")
EPS = 1e-9  # virtual-clock rounding
SPEC = preset("mixtral-8x7b", layers=3)
COST = RooflineCost(hardware("t4"))
E = SPEC.moe.experts


def scheduler(name: str, spec: ModelSpec = SPEC, **policy: object):
    context = SchedulerContext(spec, Policy(**policy), NodeFactory(spec), COST)  # type: ignore[arg-type]
    return create(name, context)


def prefill(sequences: int, prompt: int, micro_batches: int = 2) -> StepShape:
    shapes = (
        MicroBatchShape.from_lengths(i, [prompt] * sequences, [0] * sequences) for i in range(micro_batches)
    )
    return StepShape(0, True, tuple(shapes))


def decode(sequences: int, past: int, micro_batches: int = 2, step: int = 1) -> StepShape:
    shapes = (
        MicroBatchShape.from_lengths(i, [1] * sequences, [past] * sequences) for i in range(micro_batches)
    )
    return StepShape(step, False, tuple(shapes))


Routes = dict[tuple[int, int], tuple[int, ...]]  # (layer, mb) -> experts


def trace_of(steps: Iterable[StepShape], actual: Routes, predicted: Routes | None = None) -> RoutingTrace:
    """Each routed expert gets a micro-batch's tokens × top-k / (experts routed)."""
    trace = RoutingTrace()
    for step in steps:
        for mb in step.micro_batches:
            for table, speculative in ((actual, False), (predicted or {}, True)):
                for (layer, index), experts in table.items():
                    if index == mb.index:
                        tokens = max(1, mb.tokens * SPEC.moe.top_k // len(experts))
                        counts = tuple((e, tokens) for e in sorted(experts))
                        trace.record(step.step, ExpertCounts(layer, index, counts), speculative)
    return trace


def run(name: str, steps: list[StepShape], actual: Routes, predicted: Routes | None = None, **policy):
    sched = scheduler(name, **policy)
    spans = simulate(sched, steps, trace_of(steps, actual, predicted), COST)
    return sched, spans


def overlaps(a: Span, b: Span) -> bool:
    return a.start < b.end - EPS and b.start < a.end - EPS


def compute(spans: list[Span], layer: int, mb: int | None = None) -> list[Span]:
    return [
        s for s in spans
        if s.node.lane is Lane.GPU_COMPUTE and s.node.layer == layer and mb in (None, s.node.mb)
        and s.node.op is not Op.PREGATE
    ]  # fmt: skip


def of(spans: list[Span], op: Op, **where: int) -> list[Span]:
    return [s for s in spans if s.node.op is op and all(getattr(s.node, k) == v for k, v in where.items())]


def resident_peak(spans: list[Span]) -> int:
    """Most experts copied in (from the start of their copy) and not yet evicted, at any moment."""
    events = [(s.start, 1) for s in of(spans, Op.PAGE_COPY) if s.node.expert >= 0]
    events += [(s.end, -1) for s in of(spans, Op.EVICT)]
    held = peak = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # frees before copies at a tie
        held += change
        peak = max(peak, held)
    return peak


def by_id(spans: list[Span]) -> dict[int, Span]:
    return {s.node.id: s for s in spans}


# ---- on-demand

ROUTES = {
    (0, 0): (1, 4, 6),
    (0, 1): (0, 4),
    (1, 0): (2, 3, 5, 7),
    (1, 1): (1, 2),
    (2, 0): (0, 7),
    (2, 1): (3, 6),
}


def test_on_demand_fetches_each_expert_just_before_its_ffn_one_ahead_at_most() -> None:
    steps = [prefill(4, 256), decode(4, 256)]
    sched, spans = run("on-demand", steps, ROUTES)
    ids = by_id(spans)
    ffns = of(spans, Op.EXPERT_FFN)
    assert len(ffns) == 2 * sum(len(v) for v in ROUTES.values())
    ahead = 0
    for ffn in ffns:
        (copy,) = [ids[d] for d in ffn.node.deps if ids[d].node.op is Op.PAGE_COPY]
        assert (copy.node.layer, copy.node.mb, copy.node.expert) == (
            ffn.node.layer,
            ffn.node.mb,
            ffn.node.expert,
        )
        assert copy.end <= ffn.start + EPS  # resident before the FFN
        (gate,) = of(spans, Op.GATE, layer=ffn.node.layer, mb=ffn.node.mb, id=_gate_id(ffn, ids))
        assert copy.start >= gate.end - EPS  # fetched on demand: only once the gate chose it
        others = [
            f for f in ffns if f.node.layer == ffn.node.layer and f.node.mb == ffn.node.mb and f is not ffn
        ]
        ahead += any(overlaps(copy, f) for f in others)  # this copy runs while another FFN computes
    assert ahead > 0  # the buffer's second slot lets the next copy overlap the current FFN...
    assert resident_peak(spans) == sched.slots == 2  # ...but never more than one ahead
    assert sched.weight_buffer_bytes() == 2 * SPEC.expert_bytes
    assert len(of(spans, Op.EVICT)) == len(of(spans, Op.PAGE_COPY))  # every copy evicted
    assert all(s.node.lane is Lane.GPU_COMPUTE for s in ffns)


def _gate_id(ffn: Span, ids: dict[int, Span]) -> int:
    return next(d for d in ffn.node.deps if ids[d].node.op is Op.GATE)


# ---- prefetch-all


def test_prefetch_all_copies_every_expert_of_the_next_layer_during_this_one() -> None:
    steps = [decode(4, 512)]
    # the last expert copied is routed in every layer, so each layer computes once its copies end
    routes = {
        (layer, mb): (*experts, E - 1) for (layer, mb), experts in ROUTES.items() if E - 1 not in experts
    }
    sched, spans = run("prefetch-all", steps, ROUTES | routes)
    copies = of(spans, Op.PAGE_COPY)
    for layer in range(SPEC.layers):
        assert sorted(s.node.expert for s in of(spans, Op.PAGE_COPY, layer=layer)) == list(range(E))
    step_start = min(s.start for s in spans)
    assert [s.node.layer for s in sorted(copies, key=lambda s: s.start)[:E]] == [0] * E
    assert min(s.start for s in of(spans, Op.PAGE_COPY, layer=0)) == pytest.approx(step_start)
    for layer in range(SPEC.layers - 1):
        ahead = of(spans, Op.PAGE_COPY, layer=layer + 1)
        assert any(overlaps(c, s) for c in ahead for s in compute(spans, layer)), layer
        # issued, every one, when layer l began: before any routing of layer l+1 was known
        begin = min(s.start for s in compute(spans, layer))
        assert all(c.queued <= begin + EPS for c in ahead)
    for evict in of(spans, Op.EVICT):
        assert all(evict.start >= c.end - EPS for c in of(spans, Op.COMBINE, layer=evict.node.layer))
    assert resident_peak(spans) == 2 * E  # a double buffer of two layers
    assert sched.weight_buffer_bytes() == 2 * E * SPEC.expert_bytes


# ---- flexgen


def test_flexgen_zig_zag_overlaps_cache_loads_and_next_layer_weights_with_compute() -> None:
    """A block of two micro-batches of 8 prompts of 1024 tokens, 6 of 8 experts resident: a layer
    computes for longer than the next layer's weights take to copy, FlexGen's design point."""
    steps = [prefill(8, 1024)]
    routes = {(layer, 0): (0, 6) for layer in range(3)} | {(layer, 1): (3, 7) for layer in range(3)}
    sched, spans = run(
        "flexgen",
        steps,
        routes,
        weights_gpu_share=0.75,
        kv_gpu_share=0.0,
        micro_batch_size=8,
        micro_batches=2,
    )
    assert not sched.kv_on_gpu()
    assert sched.residency().experts == {(layer, e) for layer in range(3) for e in range(6)}
    order = [(layer, mb) for layer in range(3) for mb in (0, 1)]  # the zig-zag: layer outer, mb inner
    loads = {(s.node.layer, s.node.mb): s for s in of(spans, Op.KV_LOAD)}
    assert set(loads) == set(order)
    for (layer, mb), nxt in itertools.pairwise(order):
        assert any(overlaps(loads[nxt], s) for s in compute(spans, layer, mb)), ((layer, mb), nxt)
    for attn in of(spans, Op.GPU_ATTN):
        key = (attn.node.layer, attn.node.mb)
        assert loads[key].end <= attn.start + EPS
        (store,) = of(spans, Op.KV_STORE, layer=key[0], mb=key[1])
        assert store.node.lane is Lane.GPU_D2H and store.start >= attn.end - EPS
    for layer in range(2):
        weights = of(spans, Op.PAGE_COPY, layer=layer + 1)
        assert sorted(c.node.expert for c in weights) == [6, 7]  # all offloaded experts, routed or not
        assert any(overlaps(c, s) for c in weights for s in compute(spans, layer)), layer
    assert resident_peak(spans) == 4  # two layers of two offloaded experts
    assert sched.weight_buffer_bytes() == 4 * SPEC.expert_bytes


def test_flexgen_with_nothing_resident_copies_whole_layers_and_keeps_the_kv_cache_on_the_cpu() -> None:
    steps = [prefill(2, 64, micro_batches=3), decode(2, 64, micro_batches=3)]
    routes = {(layer, mb): (mb, 7) for layer in range(3) for mb in range(3)}
    sched, spans = run("flexgen", steps, routes, weights_gpu_share=0.0, kv_gpu_share=0.0, micro_batches=3)
    assert sched.residency().experts == frozenset()
    assert len(of(spans, Op.PAGE_COPY)) == 2 * 3 * E
    assert len(of(spans, Op.KV_LOAD)) == len(of(spans, Op.KV_STORE)) == 2 * 3 * 3
    assert resident_peak(spans) == 2 * E


def iterations(spans: list[Span]) -> list[list[Span]]:
    """Spans grouped by FlexGen iteration: nodes are emitted iteration by iteration, each ending with
    its COMBINE, so iteration i is every node after the COMBINE of iteration i - 1 up to its own."""
    ordered = sorted(spans, key=lambda s: s.node.id)
    groups: list[list[Span]] = [[]]
    for span in ordered:
        groups[-1].append(span)
        if span.node.op is Op.COMBINE:
            groups.append([])
    return groups[:-1]


@pytest.mark.parametrize("attention", ["gpu", "cpu"])
def test_flexgen_synchronises_once_per_layer_and_micro_batch(attention: str) -> None:
    """Algorithm 1's synchronize(): nothing of iteration (j, k + 1), compute or I/O, starts before
    every node of iteration (j, k) has finished; the I/O of an iteration overlaps its compute."""
    steps = [decode(4, 512, micro_batches=3)]
    routes = {(layer, mb): (mb, 7) for layer in range(3) for mb in range(3)}
    policy = {"weights_gpu_share": 0.5, "kv_gpu_share": 0.0, "micro_batch_size": 4, "micro_batches": 3}
    sched, spans = run("flexgen", steps, routes, attention_on=attention, **policy)
    assert not sched.kv_on_gpu()
    groups = iterations(spans)
    assert len(groups) == 3 * 3
    overlapped = 0
    for before, after in itertools.pairwise(groups):
        done = max(s.end for s in before)
        assert all(s.start >= done - EPS for s in after)
        io = [s for s in after if s.node.lane in (Lane.GPU_H2D, Lane.GPU_D2H) and s.node.op is not Op.EVICT]
        overlapped += any(overlaps(i, c) for i in io for c in after if c.node.lane is Lane.GPU_COMPUTE)
    assert overlapped >= 6
    assert len(of(spans, Op.ACT_STORE)) == len(of(spans, Op.ACT_LOAD)) == 2 * 3  # layers 0-1 out, 1-2 in
    if attention == "cpu":  # FlexGen(c): attention next to the cache, no cache transfers
        assert len(of(spans, Op.CPU_ATTN)) == 9 and not of(spans, Op.GPU_ATTN) and not of(spans, Op.KV_LOAD)
    else:
        assert len(of(spans, Op.GPU_ATTN)) == len(of(spans, Op.KV_LOAD)) == len(of(spans, Op.KV_STORE)) == 9
        assert all(s.node.pageable for s in [*of(spans, Op.KV_LOAD), *of(spans, Op.KV_STORE)])


@pytest.mark.parametrize(("share", "sequences", "kept"), [(0.5, 4, 2), (0.5, 3, 1), (0.7, 3, 2), (1.0, 4, 4)])
def test_flexgen_keeps_the_kv_gpu_share_of_the_cache_on_the_gpu(
    share: float, sequences: int, kept: int
) -> None:
    """FlexGen's cache GPU percent: each cache layer keeps ⌊share × sequences⌋ whole sequences on the
    GPU (as FlexGen rounds its split of the batch) and only the rest's share crosses the link
    (pageable); with all of it on the GPU there are no cache transfers at all."""
    steps = [decode(sequences, 512, micro_batches=2)]
    routes = {(layer, mb): (mb, 7) for layer in range(3) for mb in range(2)}
    policy = {"weights_gpu_share": 0.5, "micro_batch_size": sequences, "micro_batches": 2}
    sched, spans = run("flexgen", steps, routes, kv_gpu_share=share, **policy)
    moved = [*of(spans, Op.KV_LOAD), *of(spans, Op.KV_STORE)]
    assert sched.kv_on_gpu() == (share == 1.0) and len(of(spans, Op.GPU_ATTN)) == 6
    assert sched.kv_gpu_sequences(sequences) == kept
    if share == 1.0:
        assert not moved
    else:
        factory, mb = NodeFactory(SPEC), steps[0].micro_batches[0]
        for s in moved:
            full = factory.node(s.node.op, Lane.GPU_H2D, 0, mb).bytes
            assert s.node.pageable and s.node.bytes == full * (sequences - kept) // sequences
        assert len(moved) == 12


@pytest.mark.parametrize(
    ("name", "flag", "policy"),
    [
        ("flexgen", "--ffn-on cpu", {"ffn_on": "cpu"}),
        ("on-demand", "--attention-on cpu", {"attention_on": "cpu"}),
        ("prefetch-all", "--ffn-on cpu", {"ffn_on": "cpu"}),
        ("pre-gated", "--attention-on cpu", {"attention_on": "cpu"}),
        ("eager", "--ffn-on cpu", {"ffn_on": "cpu"}),
    ],
)
def test_unsupported_placements_are_refused_in_one_line(name: str, flag: str, policy: dict) -> None:
    with pytest.raises(FlowmoeError, match=f"^scheduler {name} does not support {flag} "):
        scheduler(name, **policy)


# ---- pre-gated

# step -> (layer, mb) -> experts; layer 0 has no prediction
ACTUAL = {
    0: {(0, 0): (0, 1), (0, 1): (2, 3), (1, 0): (1, 2), (1, 1): (3, 5), (2, 0): (0, 7), (2, 1): (2, 4)},
    1: {(0, 0): (4, 5), (0, 1): (4, 6), (1, 0): (6, 7), (1, 1): (1, 6), (2, 0): (3, 5), (2, 1): (0, 1)},
}
PREDICTED = {
    0: {(1, 0): (1, 2), (1, 1): (3, 4), (2, 0): (5, 6), (2, 1): (2, 4)},  # 2 + 1 + 0 + 2 hits of 8
    1: {(1, 0): (6, 7), (1, 1): (1, 6), (2, 0): (3, 4), (2, 1): (0, 2)},  # 2 + 2 + 1 + 1 hits of 8
}


def pregated_run(seqs: int = 1):
    steps = [prefill(seqs, 32), decode(seqs, 32)]
    trace = RoutingTrace()
    for step in steps:
        for table, speculative in ((ACTUAL, False), (PREDICTED, True)):
            for (layer, mb), experts in table[step.step].items():
                counts = tuple((e, step.micro_batches[mb].tokens) for e in experts)
                trace.record(step.step, ExpertCounts(layer, mb, counts), speculative)
    sched = scheduler("pre-gated", micro_batch_size=seqs, micro_batches=2)
    return sched, simulate(sched, steps, trace, COST), steps


def test_pre_gated_prefetches_predicted_experts_while_the_layer_before_computes() -> None:
    _, spans, _ = pregated_run()
    ids = by_id(spans)
    step_of = {}  # node id -> step, from the order of the embeds (ids grow across steps)
    firsts = sorted(s.node.id for s in of(spans, Op.EMBED, mb=0))
    for s in spans:
        step_of[s.node.id] = sum(s.node.id >= f for f in firsts) - 1
    for span in of(spans, Op.PREGATE):
        assert span.node.layer >= 1 and span.node.lane is Lane.GPU_COMPUTE
        (post,) = [ids[d] for d in span.node.deps]
        assert post.node.op is Op.POST_ATTN and post.node.layer == span.node.layer - 1
    prefetched: dict[tuple[int, int], list[Span]] = {}
    for copy in of(spans, Op.PAGE_COPY):
        step, layer, mb, expert = step_of[copy.node.id], copy.node.layer, copy.node.mb, copy.node.expert
        (source,) = [ids[d] for d in copy.node.deps]
        if source.node.op is Op.PREGATE:  # a prefetch: predicted, issued during layer l - 1
            prefetched.setdefault((step, layer), []).append(copy)
            assert expert in PREDICTED[step][(layer, mb)]
            gates = [g for g in of(spans, Op.GATE, layer=layer) if step_of[g.node.id] == step]
            assert copy.queued <= min(g.start for g in gates) + EPS  # queued before layer l gated
        else:  # on demand: after the real gate, an expert nobody predicted
            assert source.node.op is Op.GATE and copy.start >= source.end - EPS
            assert expert in ACTUAL[step][(layer, mb)]
            guesses = PREDICTED[step].get((layer, 0), ()) + PREDICTED[step].get((layer, 1), ())
            assert layer == 0 or expert not in guesses
    for (step, layer), copies in prefetched.items():  # the prefetch runs while layer l - 1 computes
        before = [s for s in compute(spans, layer - 1) if step_of[s.node.id] == step]
        assert any(overlaps(c, s) for c in copies for s in before), (step, layer)
    assert {k: len(v) for k, v in prefetched.items()} == {
        (step, layer): len(experts)
        for step, table in PREDICTED.items()
        for layer, experts in _per_layer(table).items()
    }
    for ffn in of(spans, Op.EXPERT_FFN):
        copy = next(ids[d] for d in ffn.node.deps if ids[d].node.op is Op.PAGE_COPY)
        assert copy.end <= ffn.start + EPS
    assert len(of(spans, Op.EVICT)) == len(of(spans, Op.PAGE_COPY))


def _per_layer(table: dict[tuple[int, int], tuple[int, ...]]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for (layer, _mb), experts in table.items():
        out.setdefault(layer, set()).update(experts)
    return out


def test_pre_gated_hit_rate_is_what_the_trace_implies() -> None:
    sched, _, _ = pregated_run()
    assert (sched.hits, sched.misses) == (11, 5)  # see PREDICTED: 5 of 8, then 6 of 8
    assert sched.hit_rate == pytest.approx(11 / 16)
    assert sched.report() == {"pregate_hits": 11.0, "pregate_misses": 5.0, "pregate_hit_rate": 11 / 16}
    fresh = scheduler("pre-gated")
    assert fresh.hit_rate == 0.0 and fresh.report()["pregate_hit_rate"] == 0.0


def test_pre_gated_counts_duplicate_predictions_once() -> None:
    steps = [decode(1, 8, micro_batches=1)]
    trace = RoutingTrace()
    for layer in range(3):
        trace.record(1, ExpertCounts(layer, 0, ((2, 1), (5, 1))))
        trace.record(1, ExpertCounts(layer, 0, ((5, 1), (5, 1))), speculative=True)
    sched = scheduler("pre-gated", micro_batch_size=1, micro_batches=1)
    spans = simulate(sched, steps, trace, COST)
    assert (sched.hits, sched.misses) == (2, 2)
    assert len(of(spans, Op.PAGE_COPY, layer=1, expert=5)) == 1


# ---- every one: dense layers and shared experts, memory


def test_dense_layers_and_shared_experts_copy_no_weights_for_dense_layers() -> None:
    spec = preset("qwen1.5-moe-a2.7b", layers=3)  # a shared expert in every MoE layer
    spec = evolve(spec, moe=evolve(spec.moe, dense_layers=(1,)))
    steps = [prefill(2, 16), decode(2, 16)]
    trace = RoutingTrace()
    for step in steps:
        for layer in (0, 2):
            for mb in (0, 1):
                trace.record(step.step, ExpertCounts(layer, mb, ((mb, 4), (10 + layer, 4))))
                trace.record(step.step, ExpertCounts(layer, mb, ((mb, 4), (20, 4))), speculative=True)
    for name in MINE:
        context = SchedulerContext(
            spec, Policy(micro_batches=2, weights_gpu_share=0.0), NodeFactory(spec), COST
        )
        sched = create(name, context)
        spans = simulate(sched, steps, trace, COST)
        assert not of(spans, Op.PAGE_COPY, layer=1), name
        assert not of(spans, Op.GATE, layer=1) and not of(spans, Op.EXPERT_FFN, layer=1), name
        assert len(of(spans, Op.SHARED_FFN)) == 2 * 3 * 2, name  # shared expert, and the dense MLP
        copied = sum(1 + len(s.node.more) for s in of(spans, Op.PAGE_COPY) if s.node.part <= 0)
        assert len(of(spans, Op.EVICT)) == copied, name  # each expert copied in is evicted once


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from tests.hf_models import hf_model, save_hf

    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("baselines") / "mixtral"))


@pytest.mark.parametrize("name", MINE)
def test_too_small_a_budget_fails_the_memory_check_with_what_it_needs(tiny_model, name: str) -> None:
    kv_share = 0.0 if name == "flexgen" else 1.0  # flexgen: the whole cache on the CPU
    policy = Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.0, kv_gpu_share=kv_share)
    runtime = Runtime.create(tiny_model, name, policy, device="cpu")
    try:
        need = runtime.check_memory(rectangle(4, 64, gen=1))
        assert need.buffers == runtime.scheduler.weight_buffer_bytes() > 0
        whole_cache = 4 * 64 * tiny_model.spec.kv_bytes_per_token
        # flexgen keeps the cache on the CPU: a slice of one layer attended and the next loading
        slices = 2 * 4 * 63 * tiny_model.spec.kv_bytes_per_token // tiny_model.spec.layers
        assert need.kv_cache == (slices if name == "flexgen" else whole_cache)
    finally:
        runtime.close()
    for budget, fits in ((need.total, True), (need.total - 1, False)):
        runtime = Runtime.create(tiny_model, name, evolve(policy, gpu_memory=budget), "cpu")
        try:
            if fits:
                runtime.check_memory(rectangle(4, 64, gen=1))
                continue
            with pytest.raises(MemoryBudgetError) as failure:
                runtime.check_memory(rectangle(4, 64, gen=1))
            message = str(failure.value)
            assert f"scheduler {name}" in message and "over the" in message and "budget" in message
            assert "weight buffers" in message
        finally:
            runtime.close()


@pytest.mark.parametrize("name", MINE)
def test_declared_weight_buffer_is_filled_exactly_and_emptied_after_each_step(tiny_model, name: str) -> None:
    """A real run fills the declared buffer to the byte (a byte less fails: a leak would too), and
    no copied expert outlives its step."""
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0)
    runtime = Runtime.create(tiny_model, name, policy, device="cpu")
    try:
        generate(tiny_model, runtime, new_tokens=3)
        limit = runtime.weights.limit
        peak = max(c.value for c in runtime.trace.counters if c.name == "gpu weight bytes")
        assert peak == limit
        assert runtime.weights.resident_experts == len(runtime.scheduler.residency().experts) == 0
        assert runtime.weights.nbytes == limit - runtime.scheduler.weight_buffer_bytes()
    finally:
        runtime.close()
    runtime = Runtime.create(tiny_model, name, policy, device="cpu")
    runtime.weights.limit -= 1
    try:
        with pytest.raises(FlowmoeError, match="over the scheduler's declared"):
            generate(tiny_model, runtime, new_tokens=3)
    finally:
        runtime.close()


def test_pre_gated_report_after_a_real_run(tiny_model) -> None:
    runtime = Runtime.create(tiny_model, "pre-gated", Policy(micro_batch_size=3, micro_batches=2), "cpu")
    try:
        generate(tiny_model, runtime, new_tokens=3)
    finally:
        runtime.close()
    report = runtime.scheduler.report()
    # 3 steps x 2 later MoE layers x 2 micro-batches, every routed expert counted once
    assert report["pregate_hits"] + report["pregate_misses"] >= 3 * 2 * 2 * 1
    assert 0.0 <= report["pregate_hit_rate"] <= 1.0
