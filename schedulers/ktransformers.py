"""`ktransformers`: KTransformers' CPU/GPU hybrid placement (Chen et al., "KTransformers: Unleashing the
Full Potential of CPU/GPU Hybrid Inference for MoE Models", SOSP '25; code kvcache-ai/ktransformers).

Placement (the paper's hybrid design: attention and shared experts on the GPU,
routed experts on the CPU, each where its arithmetic intensity fits): every
layer's dense part (attention, router, shared expert or dense MLP) and the KV
cache live on the GPU; the routed experts live in host memory and are computed
there, next to their weights. KTransformers' optimize rules may put whole
layers' experts on the GPU instead (its rule files match layers by index);
here the first round(`weights_gpu_share` x MoE layers) MoE layers keep their
experts on the GPU and the rest are computed on the CPU (`--ffn-on cpu`: every
MoE layer's, whatever the share).

Per layer and micro-batch: attention, the gate (GPU); then the layer's routed
experts on the CPU (HIDDEN_OFFLOAD, one EXPERT_FFN per routed expert on
cpu.compute, EXPERT_LOAD of the outputs: KTransformers submits the whole
layer's routed experts to its CPU MoE kernel at once and returns one output),
while the GPU computes the shared expert, which depends only on the attention
output: the CPU and GPU overlap within the layer (the paper's asynchronous
CPU-GPU task scheduling); COMBINE waits for both.

Expert Deferral (`--defer-experts K`, the paper's accuracy-aware mechanism; facts from
kvcache-ai/ktransformers kt-kernel/python/experts_base.py `select_deferred_experts` and
`submit_forward`, kt-kernel/operators/amx/moe_base.hpp `merge_results`, and kvcache-ai/sglang
python/sglang/srt/layers/moe/kt_ep_wrapper.py and server_args.py
`--kt-max-deferred-experts-per-token`):
- which: each token keeps its top_k - K heaviest experts (by routing weight); an expert some token
  of the batch keeps runs at once for all its tokens, and the rest, experts no token keeps, are
  deferred whole (kt-kernel marks the kept experts batch-wide; at batch 1 that is the token's K
  lightest). Here the batch is the micro-batch, and the routing answer's `ranks` say which.
- where: the CPU computes the layer's kept experts first, then the deferred ones into the next
  layer's output buffer; the layer combines without them, and the next layer's MoE output adds
  them (kt-kernel's `incremental` merge): the deferred sum enters the residual at layer l+1's
  combine, after l+1's attention and gate, which never see it. So the CPU computes layer l's
  deferred experts while the GPU runs layer l+1's attention. The plan says so: the deferred
  experts' EXPERT_FFN and EXPERT_LOAD nodes name layer l+1 as the one whose combine adds them
  (`TaskNode.combined_at`), and that combine waits for their EXPERT_LOAD.
- the last layer never defers (sglang: "the final layer always uses 0"); nor, here, a layer whose
  next layer is dense (kt-kernel picks deferred outputs up only at the next layer's MoE) or whose
  experts are on the GPU (kt-kernel defers only CPU experts).
- accuracy and speed: the paper reports CPU utilisation from below 75% to almost 100% and up to
  1.45x more decode throughput, with an average accuracy drop of at most 0.5% over its benchmarks
  (SOSP '25 abstract; sglang PR #12586: "accuracy variation below 0.5%"); kt-kernel's README
  recommends K in 1-4 and warns of noticeable accuracy loss at 5-7 (its examples are top-8 models).
K > 0 changes the model's outputs (flowmoe's eager reference with the same deferral,
MoEModel.forward(deferral=...), gives its tokens): it is an explicit opt-in, excluded from the
same-tokens contract; K = 0 (the default) is exact, eager's tokens. K must be below the model's
top-k (a token keeps at least one expert); only this scheduler takes it.

Deviations: no AMX/AVX-512 kernels, CUDA graph of the decode step or
NUMA-aware expert sharding: the CPU expert's time is the cost model's (a
hardware preset or a `flowmoe calibrate` profile). Expert Deferral as above:
the deferred experts' output crosses the link as its own EXPERT_LOAD (kt-kernel
merges it on the CPU into the next layer's output), and in `flowmoe simulate`
a synthetic routing ranks a token's experts by the order it drew them.
`--attention-on cpu` is refused (KTransformers keeps attention on the GPU).
"""

from __future__ import annotations

from typing import ClassVar

from attrs import evolve, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.options import check_options, option
from flowmoe.core.plan import ExpertCounts, Lane, Op
from flowmoe.core.ranges import IntRange
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.core.spec import ModelSpec
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    cpu_experts,
    gate_and_route,
    model_order,
    moe_layers,
)


def check_defer(defer: int, spec: ModelSpec) -> None:
    """Expert Deferral keeps at least one expert of each token in its own layer."""
    if defer and defer >= spec.moe.top_k:
        raise ConfigError(
            f"--defer-experts {defer} must be below the model's top-k ({spec.moe.top_k}): "
            "each token keeps at least one expert in its own layer"
        )


@frozen
class KTransformersOptions:
    """KTransformers' Expert Deferral."""

    defer_experts: int = option(
        0,
        "KTransformers' Expert Deferral: experts per token whose output goes into the next layer, so the "
        "CPU computes them during its attention (0: none). K > 0 CHANGES THE MODEL'S OUTPUTS (not eager's "
        "tokens; the paper reports <= 0.5% accuracy drop)",
        IntRange(0),
        label="defer",
        check=check_defer,
        caution="KTransformers' Expert Deferral changes the model's outputs (not eager's tokens; "
        "bench/deferral.py measures by how much)",
    )


class KTransformersScheduler(Scheduler):
    name: ClassVar[str] = "ktransformers"
    summary: ClassVar[str] = (
        "KTransformers hybrid placement: routed experts on the CPU (the first weights_gpu_share of MoE "
        "layers on the GPU), attention and shared experts on the GPU, overlapping; K = 0 (default) is "
        "exact. --defer-experts K > 0 (Expert Deferral) CHANGES OUTPUTS: not eager's tokens"
    )
    Options: ClassVar[type[KTransformersOptions]] = KTransformersOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        self.options = policy.options_for(self.Options)
        check_options(self.options, spec)
        check_placement(self.name, policy, ffn=("gpu", "cpu"))
        moe = moe_layers(spec) if policy.ffn_on == "gpu" else []
        self.on_gpu = frozenset(moe[: round(policy.weights_gpu_share * len(moe))])
        self.defer = self.options.defer_experts
        self.deferring = deferring_layers(spec, self.on_gpu) if self.defer else frozenset()
        self._carried: dict[int, int] = {}  # micro-batch -> the EXPERT_LOAD of its last deferred experts

    def residency(self) -> Residency:
        spec = self.context.spec
        experts = frozenset((layer, e) for layer in self.on_gpu for e in range(spec.moe.experts))
        return Residency(Residency.dense_only(spec).dense, experts)

    def plan(self, step: StepShape) -> PlanStream:
        self._carried = {}
        return model_order(self.context.factory, self.context.spec, step, self._experts)

    def _experts(self, layer: int, mb: MicroBatchShape, post: int) -> SubPlan[list[int]]:
        """The layer's experts; returns what its combine waits for: its own (kept) experts' outputs and
        the previous layer's deferred ones."""
        f = self.context.factory
        defer = self.defer if layer in self.deferring else 0
        gate, counts = yield from gate_and_route(f, layer, mb, post, defer)
        carried = [self._carried.pop(mb.index)] if mb.index in self._carried else []
        if layer in self.on_gpu:
            ffns = [
                f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate], tokens=n)
                for e, n in counts.counts
            ]
            yield from ffns
            return [n.id for n in ffns] + carried
        later = set(self._deferred(counts, defer))
        on_cpu = cpu_experts(f, layer, mb, gate, [(e, n) for e, n in counts.counts if e not in later])
        yield from on_cpu
        if later:  # after the kept experts on the CPU lane; the next layer's combine adds them
            deferred = [(e, n) for e, n in counts.counts if e in later]
            nodes = cpu_experts(f, layer, mb, gate, deferred, offload=on_cpu[0] if on_cpu else None)
            nodes = [evolve(n, combined_at=layer + 1) if n.op in EXPERT_OUTPUTS else n for n in nodes]
            yield from nodes
            self._carried[mb.index] = nodes[-1].id
        return ([on_cpu[-1].id] if on_cpu else []) + carried

    def _deferred(self, counts: ExpertCounts, defer: int) -> tuple[int, ...]:
        if not defer:
            return ()
        if counts.counts and not counts.ranks:
            raise ConfigError(
                f"--defer-experts: the routing of layer {counts.layer} has no expert ranks (routing "
                "weights); use a synthetic routing or a trace recorded with --defer-experts"
            )
        return counts.deferrable(self.context.spec.moe.top_k - defer)


EXPERT_OUTPUTS = (Op.EXPERT_FFN, Op.EXPERT_LOAD)  # the nodes that make or move an expert's output


def deferring_layers(spec: ModelSpec, on_gpu: frozenset[int] = frozenset()) -> frozenset[int]:
    """MoE layers whose deferred experts go into the next layer: CPU-expert layers followed by an MoE
    layer (not the last layer, not one before a dense layer, not one whose experts are on the GPU)."""
    moe = moe_layers(spec)
    return frozenset(layer for layer in moe if layer not in on_gpu and layer + 1 in moe)
