"""lru-cache with GPU misses (Mixtral-offloading's LRU): a miss is fetched at once and computed on the
GPU, nothing runs on the CPU, the cache's hits need no copy, and the tokens are eager's."""

from __future__ import annotations

import pytest

from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.study.simulate import simulate
from tests.schedule_fixtures import run_eager, run_scheduler
from tests.test_sched_baselines import SPEC, by_id, decode, of, prefill, scheduler, trace_of

# the same experts in both steps: the decode step hits what prefill fetched (4 ways hold 3 experts)
ROUTES = {(0, 0): (1, 4, 6), (0, 1): (1, 4), (1, 0): (2, 3), (1, 1): (2, 5), (2, 0): (0, 7), (2, 1): (3, 6)}


def gpu_miss_run(slots: int):
    steps = [prefill(4, 256), decode(4, 256, step=1)]
    options = (LRUCacheOptions(expert_cache_slots=slots, cache_ways=4, gpu_misses=1),)
    sched = scheduler("lru-cache", micro_batch_size=4, micro_batches=2, options=options)
    cost = sched.context.cost
    return sched, simulate(sched, steps, trace_of(steps, ROUTES), cost)


def test_misses_run_on_the_gpu_after_their_fetch_and_hits_need_no_copy() -> None:
    sched, spans = gpu_miss_run(slots=3 * 4)  # every MoE layer has a set
    ffns = of(spans, Op.EXPERT_FFN)
    assert ffns and all(s.node.lane is Lane.GPU_COMPUTE for s in ffns)
    assert not of(spans, Op.HIDDEN_OFFLOAD) and not of(spans, Op.EXPERT_LOAD)
    ids = by_id(spans)
    fetched = [f for f in ffns if any(ids[d].node.op is Op.PAGE_COPY for d in f.node.deps)]
    report = sched.report()
    assert report["misses"] == len({(s.node.layer, s.node.expert) for s in of(spans, Op.PAGE_COPY)})
    for ffn in fetched:
        copy = next(ids[d] for d in ffn.node.deps if ids[d].node.op is Op.PAGE_COPY)
        assert copy.end <= ffn.start + 1e-9  # after its last page (a run of pages: one node)
        assert copy.node.part + copy.node.pages == copy.node.parts
    assert report["hits"] > 0 and report["hits"] + report["misses"] == len(ffns)
    assert sched.weight_buffer_bytes() == 3 * 4 * SPEC.expert_bytes


def test_layers_without_a_set_copy_each_expert_into_one_transient_buffer() -> None:
    sched, spans = gpu_miss_run(slots=4)  # only MoE layer 0 has a set
    uncovered = [s for s in of(spans, Op.PAGE_COPY) if s.node.layer > 0]
    assert len(uncovered) == 2 * sum(len(v) for (layer, _), v in ROUTES.items() if layer > 0)
    assert len(of(spans, Op.EVICT)) >= len(uncovered)
    assert sched.weight_buffer_bytes() == (4 + 1) * SPEC.expert_bytes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from tests.hf_models import hf_model, save_hf

    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("lru-gpu") / "mixtral"))


@pytest.mark.parametrize("slots", [2, 8])  # the tiny model: some layers without a set / every layer
def test_gpu_misses_give_eager_tokens(tiny_model, slots: int) -> None:
    options = (LRUCacheOptions(expert_cache_slots=slots, cache_ways=2, gpu_misses=1),)
    policy = Policy(micro_batch_size=3, micro_batches=2, options=options)
    (results, _), runtime = run_scheduler(tiny_model, "lru-cache", policy, device="cpu")
    (reference, _) = run_eager(tiny_model)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert runtime.scheduler.report()["misses"] > 0
