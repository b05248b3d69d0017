"""Shared fixtures for scheduler tests: a tiny spec, a fixed routing trace, a runtime harness."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from attrs import evolve

from flowmoe.core.plan import ExpertCounts
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace, lane_listing, replay
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.jobs.engine import Engine, Request, Result, StepInput, eager_step
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.hybrimoe import HybriMoEOptions
from flowmoe.schedulers.lru_cache import LRUCacheOptions
from flowmoe.schedulers.registry import available, create
from flowmoe.schedulers.shared_options import ExpertCacheOptions, PagedOptions
from flowmoe.traces.trace import Trace
from tests.helpers import rel_err

TINY_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2,
}  # fmt: skip
PAGES_8K = (PagedOptions(page_bytes=8192), LRUCacheOptions(page_bytes=8192))  # 8 KiB pages, where paged
GOLDEN_POLICY = Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.0, options=PAGES_8K)
# where the common policy would hide what a scheduler does: lru-cache with one 2-way index (layer 0
# cached, layer 1 on the CPU), cgopipe with CPU attention, flexgen with its cache on the CPU
GOLDEN_POLICIES = {
    "lru-cache": GOLDEN_POLICY.with_options(
        LRUCacheOptions(page_bytes=8192, expert_cache_slots=2, cache_ways=2)
    ),
    "cgopipe": evolve(GOLDEN_POLICY, attention_on="cpu"),  # Algorithm 1's CPU attention
    "flexgen": evolve(GOLDEN_POLICY, kv_gpu_share=0.0),  # the cache on the CPU, loaded per micro-batch
    "hybrimoe": GOLDEN_POLICY.with_options(HybriMoEOptions(expert_cache_slots=2)),  # MRS evictions
    "fate": GOLDEN_POLICY.with_options(ExpertCacheOptions(expert_cache_slots=3)),  # what ARC keeps
}


def golden_steps() -> list[StepShape]:
    """A prefill and a decode step of two micro-batches of two sequences."""
    prefill = tuple(MicroBatchShape.from_lengths(i, [5, 3], [0, 0]) for i in range(2))
    decode = tuple(MicroBatchShape.from_lengths(i, [1, 1], [5, 3]) for i in range(2))
    return [StepShape(0, True, prefill), StepShape(1, False, decode)]


def golden_trace() -> RoutingTrace:
    """Expert choices that differ per layer and micro-batch, with a skew (expert 0 popular)."""
    trace = RoutingTrace()
    choices = {0: ((0, 4), (2, 3), (3, 1)), 1: ((0, 2), (1, 2)), 2: ((0, 3), (1, 1)), 3: ((1, 1), (3, 1))}
    for step in (0, 1):
        for layer in range(2):
            for mb in range(2):
                counts = choices[(layer * 2 + mb + step) % 4]
                trace.record(step, ExpertCounts(layer, mb, counts))
                predicted = choices[(layer * 2 + mb + step + 1) % 4]  # a pre-gate's guess: partly right
                trace.record(step, ExpertCounts(layer, mb, predicted), speculative=True)
    return trace


def golden_listing(name: str, policy: Policy | None = None) -> str:
    policy = policy or GOLDEN_POLICIES.get(name, GOLDEN_POLICY)
    spec = ModelSpec.from_hf(TINY_CONFIG)
    scheduler = create(name, SchedulerContext(spec, policy, NodeFactory(spec)))
    trace = golden_trace()
    out = []
    for step in golden_steps():
        nodes = list(replay(scheduler.plan(step), lambda r, s=step.step: trace.answer(s, r)))
        out.append(f"# step {step.step} ({'prefill' if step.prefill else 'decode'})\n{lane_listing(nodes)}")
    return "\n".join(out)


def gpu_schedulers() -> list[str]:
    """The registered schedulers that compute on a GPU (`Scheduler.uses_gpu`): all but a CPU-only one,
    which never touches the CUDA paths (streams, events, the device's copies) GPU tests check."""
    spec = ModelSpec.from_hf(TINY_CONFIG)
    made = {name: create(name, SchedulerContext(spec, Policy(), NodeFactory(spec))) for name in available()}
    return sorted(name for name, scheduler in made.items() if scheduler.uses_gpu())


REQUESTS = [Request(str(i), tuple(range(3 + i, 3 + i + 4 + 2 * i)), i) for i in range(5)]


def generate(
    model: MoEModel, runner, micro_batches: int = 2, new_tokens: int = 6, prefill_chunk: int | None = None
):
    """-> (results sorted by id, every runner call's logits per micro-batch; `prefill_chunk`: the
    engine's tokens per call)."""
    logits: list[list[torch.Tensor]] = []

    async def recording(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        out = await runner(m, inputs)
        logits.append([t.clone() for t in out])
        return out

    async def go() -> list[Result]:
        homes = runner.cache_device if isinstance(runner, Runtime) else "cpu"
        engine = Engine(model, recording, max_new_tokens=new_tokens, cache_device=homes,
                        prefill_chunk=prefill_chunk)  # fmt: skip
        size = -(-len(REQUESTS) // micro_batches)
        mbs = [engine.micro_batch(i, REQUESTS[i * size : (i + 1) * size]) for i in range(micro_batches)]
        return [r async for r in engine.run_batch(mbs)]

    return sorted(asyncio.run(go()), key=lambda r: r.id), logits


def assert_as_eager(ours: tuple[list[Result], list[list[torch.Tensor]]], reference) -> None:
    """`generate`'s (results, logits) against eager's: the same tokens, as many runner calls, and each
    call's logits per micro-batch within 1e-5 (fp32)."""
    (results, logits), (ref_results, ref_logits) = ours, reference
    assert [r.output_ids for r in results] == [r.output_ids for r in ref_results]
    assert len(logits) == len(ref_logits)
    for call, (mine, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        for mb, (a, b) in enumerate(zip(mine, ref, strict=True)):
            assert rel_err(a, b) <= 1e-5, f"call {call} mb {mb}"


def run_scheduler(model: MoEModel, name: str, policy: Policy | None = None, device: str = "auto"):
    """`name`'s tokens and logits on the built-in prompts (`device`: "auto" takes CUDA where visible;
    "cpu" emulates the GPU on the CPU, for budgets no real GPU can be held to)."""
    runtime = Runtime.create(model, name, policy or Policy(micro_batch_size=3, micro_batches=2), device)
    try:
        return generate(model, runtime), runtime
    finally:
        runtime.close()


def run_through(model: MoEModel, name: str, policy: Policy, devices: Devices, workers, events):
    """`name`'s tokens and logits on the built-in prompts with these `workers` (the fake CUDA's, say),
    its weights on `devices` in the policy's expert format."""
    form = policy.expert_format
    plugin = create(name, SchedulerContext(model.spec, policy, NodeFactory(model.spec, expert_format=form)))
    weights = DeviceWeights(model, devices, expert_format=form)
    weights.setup(plugin.residency(), plugin.weight_buffer_bytes())
    runtime = Runtime(model, plugin, devices, weights, workers, events, Trace(name=name))
    try:
        return generate(model, runtime)
    finally:
        runtime.close()


def run_eager(model: MoEModel):
    return generate(model, eager_step)
