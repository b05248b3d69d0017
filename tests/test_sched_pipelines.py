"""cgopipe, klotski, fiddler and lru-cache: the same tokens as eager with weights actually paged,
and each paper's signature on the virtual clock at paper-size shapes (Mixtral-8x7B, 4 layers, T4)."""

from __future__ import annotations

import pytest
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Span
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import ExpertCounts, Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.engine import eager_step
from flowmoe.loading import load_model
from flowmoe.runtime import Runtime
from flowmoe.schedulers.registry import create
from tests.helpers import rel_err
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import generate

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
    "cgopipe": ("cgopipe", Policy(**MBS, weights_gpu_share=0.25, page_bytes=4096), None),
    "klotski": ("klotski", Policy(**MBS, weights_gpu_share=0.0, hot_experts=2), None),
    "fiddler-copies": ("fiddler", Policy(**MBS, weights_gpu_share=0.25), None),
    "fiddler-cpu": ("fiddler", Policy(**MBS, weights_gpu_share=0.25), CHEAP_CPU),
    "lru-cache": ("lru-cache", Policy(**MBS, expert_cache_slots=4, cache_ways=2), None),
}


@pytest.mark.parametrize("case", sorted(OFFLOADED))
def test_same_tokens_as_eager_with_weights_offloaded(model, reference, case: str) -> None:
    """Weights paged in under the declared buffer (the runtime enforces it), experts evicted,
    experts on the CPU: tokens and logits still those of eager."""
    name, policy, hw = OFFLOADED[case]
    runtime = Runtime.create(model, name, policy, cost=RooflineCost(hw) if hw else None)
    try:
        results, logits = generate(model, runtime, micro_batches=3)
    finally:
        runtime.close()
    ref_results, ref_logits = reference
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    for ours, ref in zip(logits, ref_logits, strict=True):
        for a, b in zip(ours, ref, strict=True):
            assert rel_err(a, b) <= 1e-5
    lanes = {(s.node.op, s.node.lane) for s in runtime.trace.spans}
    assert (Op.PAGE_COPY, Lane.GPU_H2D) in lanes or case == "fiddler-cpu"
    assert ((Op.EXPERT_FFN, Lane.CPU_COMPUTE) in lanes) == (case in ("fiddler-cpu", "lru-cache"))
