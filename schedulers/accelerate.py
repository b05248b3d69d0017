"""`accelerate`: Hugging Face Accelerate's `device_map` offload, as its hooks run it (issue 28).

`dispatch_model` with part of the model on "cpu" attaches an `AlignDevicesHook(offload=True)` to
every module with weights of its own (`attach_align_device_hook`, accelerate/hooks.py): before the
module's forward, `pre_forward` copies each of its tensors from the CPU state dict (plain, pageable
memory) to the GPU (`set_module_tensor_to_device`: `value.to(device)`, a synchronous copy in the
current stream), and after it `post_forward` drops them again (back to "meta"). Nothing is
prefetched and nothing overlaps: copy, compute, free, module after module.

Which expert modules a MoE layer calls depends on the transformers version (`fused_experts`):
- 1 (transformers >= 5, e.g. the 5.24 in this venv): a layer's experts are one module of 3-D
  tensors (`MixtralExperts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; Qwen3-MoE the same),
  so its hook moves every expert of the layer, in two tensors, whatever the router chose;
- 0 (transformers 4.x, what the published Accelerate baselines ran): one module per expert
  (`MixtralBlockSparseTop2MLP` with w1, w2, w3), three tensors each. Which of them the layer calls
  is `empty_calls`:
  - 0: only the routed ones move. transformers 4.36.0-4.39.3 skip an expert without tokens
    (`if top_x.shape[0] == 0: continue` in `MixtralSparseMoeBlock.forward`), later versions loop over
    the hit experts only (`expert_hitted`: Mixtral and Qwen2-MoE from 4.52.0, Qwen3-MoE from 4.53.0),
    and DeepSeek-V2's remote code (`DeepseekV2MoE.moe_infer`: `if num_tokens == 0: continue`) always
    skips;
  - 1: every expert of the layer moves, in index order. In between the loop is
    `for expert_idx in range(self.num_experts)` with no skip (Mixtral and Qwen2-MoE 4.40.0-4.51.3,
    Qwen3-MoE 4.51.0-4.52.4, its first releases), so an expert without tokens is called with 0 rows
    and its hooks copy its tensors in and free them all the same. Such a call has no FFN node (nothing
    to compute), so of its host costs only its tensors' are charged (3 x 80 us), not the wrapper's 32 us.

`device_map="auto"` fills the GPU with whole layers in order: here the first
`weights_gpu_share` of the MoE layers keep their experts on the GPU, the others are offloaded. The
dense part of every layer (attention, router, shared expert or dense MLP) stays resident by default;
`offload_dense` 1 moves it too, as `device_map` does where it places whole decoder layers on "cpu"
(their attention's and norms' modules are hooked like the experts'), and as DeepSpeed ZeRO-3
(ZeRO-Inference) does: it partitions every
parameter larger than `stage3_param_persistence_threshold` (1e5 elements by default) and gathers a
module's parameters in its pre-forward hook, releasing them after (deepspeed/runtime/zero/
parameter_offload.py, partitioned_param_coordinator.py), so an offloaded layer's attention and shared
expert cross the link every step like its experts. The dense part is one PAGE_COPY before the layer's
attention (the runtime moves a layer's dense part in one piece), evicted after the layer's last
micro-batch; from the first offloaded layer on (at weights share 0: every layer). Each expert tensor
is one PAGE_COPY node, marked pageable and synchronous; the scheduler's `host_family` prices each
node with Accelerate's measured hook costs (`core.host_costs.ACCELERATE`; a dense part's several
tensors are charged as one). Not moved: the embedding and the LM head (resident here, gathered by
ZeRO-3 too).

Accelerate's `set_module_tensor_to_device` ends with `torch.cuda.empty_cache()` (0.27.2,
accelerate/utils/modeling.py, unconditionally; 0.30.1 when the target is not "cpu"; 1.2.1 the same
through `clear_device_cache()`; accelerate#3796, 2025-09, skips it only for cpu-to-meta moves), so each
hooked tensor's move in (to the GPU) and out (to "meta") hands the caching allocator's free blocks
back to the driver and the next move allocates afresh (cudaFree, which synchronizes the device, and
cudaMalloc). The fixed host costs come from a machine without CUDA, where `empty_cache` does nothing;
on a GPU (bench/gpu-runs/2026-11-28-h200/hooks.json) a hooked Mixtral expert module takes 47.36 ms
against 44.69 ms for plain `.to(cuda)` calls of its tensors, and both far longer than its bytes at the
host's measured pageable peak (18.15 ms): the family's per-byte cost (`host_costs.ACCELERATE`) carries
that whole difference, `empty_cache` included, for the one tensor size measured.
"""

from __future__ import annotations

from typing import ClassVar

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.options import option
from flowmoe.core.plan import Lane, Op, TaskNode
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
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    embeddings,
    gate_and_route,
    gpu_attention,
    layer_tail,
    lm_heads,
    model_order,
    moe_layers,
)

ROUTED_TENSORS = 3  # w1, w3, w2 of one expert module (transformers 4.x)
FUSED_TENSORS = 2  # gate_up_proj and down_proj of a layer's experts module (transformers >= 5)


@frozen
class AccelerateOptions:
    """Whether a layer's experts are one module (every expert moves) or one module each (the routed
    ones move, or every one where empty calls are made), and whether the offloaded layers' dense parts
    move too."""

    fused_experts: int = option(
        1, "1: a layer's experts are one module, all of them copied per call (transformers >= 5); "
        "0: one module per expert, the routed ones copied (transformers 4.x; every one: --empty-calls)",
        IntRange(0, 1), label="fused",
    )  # fmt: skip
    empty_calls: int = option(
        0, "with --fused-experts 0: 1: every expert module is called, those without tokens with 0 rows, so "
        "all of an offloaded layer's experts are copied in and freed in index order (transformers "
        "4.40-4.51; Qwen3-MoE to 4.52); 0: only the routed ones (4.36-4.39 and later ones skip them)",
        IntRange(0, 1), label="empty",
    )  # fmt: skip
    offload_dense: int = option(
        0, "1: each offloaded layer's dense part (attention, router, shared expert or dense MLP) is copied "
        "in before its attention and freed after the layer, as DeepSpeed ZeRO-3 gathers every parameter; "
        "0: it stays resident", IntRange(0, 1), label="dense",
    )  # fmt: skip


class AccelerateScheduler(Scheduler):
    name: ClassVar[str] = "accelerate"
    summary: ClassVar[str] = (
        "Accelerate device_map offload: each offloaded module's tensors copied synchronously from "
        "pageable memory before its forward, freed after; no overlap"
    )
    Options: ClassVar[type[AccelerateOptions]] = AccelerateOptions
    host_family: ClassVar[str] = "accelerate"
    pageable: ClassVar[bool] = True  # its copies' host side: Accelerate's weights map is plain CPU memory

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        check_placement(self.name, context.policy)
        self.options = context.policy.options_for(self.Options)
        if self.options.empty_calls and self.options.fused_experts:
            raise ConfigError(
                f"{self.name}: --empty-calls 1 needs --fused-experts 0 (a fused module moves every expert)"
            )
        moe = moe_layers(context.spec)
        self.resident = frozenset(moe[: int(context.policy.weights_gpu_share * len(moe) + 1e-9)])
        offloaded = [layer for layer in moe if layer not in self.resident]
        # device_map's order: the layers before the first offloaded MoE layer keep their dense parts
        first = (offloaded[0] if self.resident else 0) if offloaded else context.spec.layers
        self.dense_offloaded = range(first, context.spec.layers) if self.options.offload_dense else range(0)

    def residency(self) -> Residency:
        spec = self.context.spec
        experts = {(layer, e) for layer in self.resident for e in range(spec.moe.experts)}
        dense = frozenset(range(spec.layers)) - frozenset(self.dense_offloaded)
        return Residency(dense, frozenset(experts))

    def weight_buffer_bytes(self) -> int:
        spec = self.context.spec
        dense = max((spec.layer_dense_bytes(layer) for layer in self.dense_offloaded), default=0)
        if len(self.resident) == len(moe_layers(spec)):
            return dense
        return dense + spec.expert_bytes * (spec.moe.experts if self.options.fused_experts else 1)

    def plan(self, step: StepShape) -> PlanStream:
        if not self.dense_offloaded:
            return model_order(self.context.factory, self.context.spec, step, self._experts)
        return self._plan_dense_offloaded(step)

    def _plan_dense_offloaded(self, step: StepShape) -> PlanStream:
        """`model_order` with each offloaded layer's dense part copied in (synchronous, pageable) before
        its first micro-batch's attention and evicted after its last micro-batch's tail."""
        f, spec = self.context.factory, self.context.spec
        nodes, last = embeddings(f, step)
        yield from nodes
        for layer in range(spec.layers):
            copy = None
            if layer in self.dense_offloaded:
                after = list(last.values())
                copy = f.node(
                    Op.PAGE_COPY, Lane.GPU_H2D, layer, deps=after, pageable=self.pageable, sync=True
                )
                yield copy
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index] if copy is None else copy.id)
                yield from attention
                post = attention[-1].id
                outputs = (yield from self._experts(layer, mb, post)) if spec.is_moe_layer(layer) else []
                tail = layer_tail(f, spec, layer, mb, post, outputs)
                yield from tail
                last[mb.index] = tail[-1].id
            if copy is not None:
                yield f.node(Op.EVICT, Lane.GPU_H2D, layer, deps=list(last.values()))
        yield from lm_heads(f, step, last)

    def _experts(self, layer: int, mb: MicroBatchShape, post: int) -> SubPlan[list[int]]:
        """Gate, then the hooks: copy a module's tensors, its forward, free them; one module at a time.
        Returns the FFN node ids."""
        f = self.context.factory
        gate, counts = yield from gate_and_route(f, layer, mb, post)
        if layer in self.resident:
            kept = [f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate], tokens=t)
                    for e, t in counts.counts]  # fmt: skip
            yield from kept
            return [n.id for n in kept]
        if self.options.fused_experts:
            return (yield from self._fused(layer, mb, gate, counts.counts))
        routed = dict(counts.counts)  # expert -> tokens
        called = range(self.context.spec.moe.experts) if self.options.empty_calls else routed
        ffns: list[int] = []
        last = gate
        for expert in called:
            copies = yield from self._copies(layer, mb, [expert], ROUTED_TENSORS, last)
            freed_after = copies  # a call with 0 rows: its hooks copy and free, nothing is computed
            if expert in routed:
                ffn = f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=[gate, copies],
                             tokens=routed[expert])  # fmt: skip
                yield ffn
                ffns.append(ffn.id)
                freed_after = ffn.id
            evict = f.node(Op.EVICT, Lane.GPU_H2D, layer, mb, expert, deps=[freed_after])
            yield evict
            last = evict.id
        return ffns

    def _fused(
        self, layer: int, mb: MicroBatchShape, gate: int, counts: tuple[tuple[int, int], ...]
    ) -> SubPlan[list[int]]:
        """The layer's experts module: both tensors of every expert in, the routed experts' FFNs, out."""
        f, experts = self.context.factory, list(range(self.context.spec.moe.experts))
        copies = yield from self._copies(layer, mb, experts, FUSED_TENSORS, gate)
        ffns = [f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, copies], tokens=t)
                for e, t in counts]  # fmt: skip
        yield from ffns
        ids = [n.id for n in ffns]
        for expert in experts:
            yield f.node(Op.EVICT, Lane.GPU_H2D, layer, mb, expert, deps=ids or [copies])
        return ids

    def _copies(
        self, layer: int, mb: MicroBatchShape, experts: list[int], tensors: int, after: int
    ) -> SubPlan[int]:
        """One synchronous PAGE_COPY per tensor of a module holding `experts` (pageable or pinned: the
        class's `pageable`), one after the other, the first after `after`; returns the last one's id."""
        last = after
        for tensor in range(tensors):
            copy: TaskNode = self.context.factory.node(
                Op.PAGE_COPY, Lane.GPU_H2D, layer, mb, experts[0], deps=[last], part=tensor, parts=tensors,
                pageable=self.pageable, sync=True, more=experts[1:],
            )  # fmt: skip
            yield copy
            last = copy.id
        return last


class ZeroInferenceScheduler(AccelerateScheduler):
    """DeepSpeed ZeRO-3 / ZeRO-Inference with `offload_param` on the CPU, one GPU: the plan of
    `accelerate` (ZeRO-3's hooks fetch a module's parameters before its forward and release them after,
    with nothing prefetched once an MoE's module order invalidates its trace, DeepSpeed #4808), its copies
    from pinned memory (`offload_param.pin_memory`) and priced with ZeRO-3's own hook costs
    (`core.host_costs.DEEPSPEED`). The stand-ins run it with one module per expert and the dense parts
    offloaded too (`--fused-experts 0 --offload-dense 1`)."""

    name: ClassVar[str] = "zero-inference"
    summary: ClassVar[str] = (
        "DeepSpeed ZeRO-Inference: each module's parameters copied from pinned memory before its forward "
        "by ZeRO-3's hooks, released after; no overlap"
    )
    host_family: ClassVar[str] = "deepspeed"
    pageable: ClassVar[bool] = False
