"""The plugin SDK: node builders every scheduler shares (public: third-party schedulers import it).

The pieces every plan has in the same shape whatever the schedule: embeddings,
attention on the GPU, a layer's tail (shared expert or dense MLP, then combine),
experts computed on the CPU next to their weights, the LM head, and the whole
model-order walk the simplest schedules differ from only in their experts; plus
the latency model a scheduler prices its choices with and the popularity
ranking of experts.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction

import structlog
from attrs import evolve, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError, PlanError
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import (
    MicroBatchShape,
    NodeFactory,
    PlanStream,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.core.spec import ModelSpec

Cost = Callable[[TaskNode], float]
DEFAULT_HARDWARE = "t4"
log = structlog.get_logger("flowmoe.schedulers")


def latency_model(context: SchedulerContext, scheduler: str) -> Cost:
    """The context's cost function (a hardware preset's or a `flowmoe calibrate` profile's roofline);
    without one, the default preset's, said in a warning since it describes another machine."""
    if context.cost is not None:
        return context.cost
    log.warning("latency model defaulted", scheduler=scheduler, hardware=DEFAULT_HARDWARE,
                fix="pass --hardware with a preset or a `flowmoe calibrate` profile")  # fmt: skip
    return RooflineCost(hardware(DEFAULT_HARDWARE), context.spec)


def check_placement(
    name: str, policy: Policy, attention: Sequence[str] = ("gpu",), ffn: Sequence[str] = ("gpu",)
) -> None:
    """Refuse, in one line naming the scheduler and the flag, a placement its paper does not have."""
    for flag, value, allowed in (
        ("--attention-on", policy.attention_on, attention),
        ("--ffn-on", policy.ffn_on, ffn),
    ):
        if value not in allowed:
            raise ConfigError(
                f"scheduler {name} does not support {flag} {value} (its paper has {' or '.join(allowed)})"
            )


def needs_shared(spec: ModelSpec, layer: int) -> bool:
    """SHARED_FFN runs on dense layers (their MLP) and on MoE layers of families with shared experts."""
    return not spec.is_moe_layer(layer) or spec.moe.has_shared


def two_layers_bytes(per_layer: Sequence[int]) -> int:
    """The most any two consecutive layers hold: the buffer of a layer computing and the next copying."""
    return max((a + b for a, b in zip(per_layer, [*per_layer[1:], 0], strict=True)), default=0)


def moe_layers(spec: ModelSpec) -> list[int]:
    return [layer for layer in range(spec.layers) if spec.is_moe_layer(layer)]


def embeddings(f: NodeFactory, step: StepShape) -> tuple[list[TaskNode], dict[int, int]]:
    """EMBED of every micro-batch, and each micro-batch's last node so far."""
    nodes = [f.node(Op.EMBED, Lane.GPU_COMPUTE, mb=mb) for mb in step.micro_batches]
    return nodes, {mb.index: node.id for mb, node in zip(step.micro_batches, nodes, strict=True)}


def gpu_attention(f: NodeFactory, layer: int, mb: MicroBatchShape, after: int) -> list[TaskNode]:
    """PRE_ATTN -> GPU_ATTN -> POST_ATTN with the KV cache on the GPU; the last node is POST_ATTN."""
    gpu = Lane.GPU_COMPUTE
    pre = f.node(Op.PRE_ATTN, gpu, layer, mb, deps=[after])
    attn = f.node(Op.GPU_ATTN, gpu, layer, mb, deps=[pre.id])
    return [pre, attn, f.node(Op.POST_ATTN, gpu, layer, mb, deps=[attn.id])]


@frozen
class OffloadedAttention:
    """Attention on the GPU over a KV cache whose home is the CPU, its nodes by name; iterated, in
    launch order. A scheduler that stores the cache its own way swaps `store` (`attrs.evolve`)."""

    pre: TaskNode  # PRE_ATTN
    attn: TaskNode  # GPU_ATTN
    store: TaskNode  # KV_STORE of this step's k, v (d2h)
    post: TaskNode  # POST_ATTN

    def __iter__(self) -> Iterator[TaskNode]:
        return iter((self.pre, self.attn, self.store, self.post))


def offloaded_kv_attention(
    f: NodeFactory, layer: int, mb: MicroBatchShape, after: int, kv_load: int, weights: int | None = None
) -> OffloadedAttention:
    """PRE_ATTN (after `weights`, the copy of the layer's dense part, if any) -> GPU_ATTN (after
    `kv_load` brought the cache layer in) -> KV_STORE of this step's k, v (d2h) -> POST_ATTN, for a
    KV cache whose home is the CPU."""
    gpu = Lane.GPU_COMPUTE
    pre = f.node(Op.PRE_ATTN, gpu, layer, mb, deps=[after, weights])
    attn = f.node(Op.GPU_ATTN, gpu, layer, mb, deps=[pre.id, kv_load])
    store = f.node(Op.KV_STORE, Lane.GPU_D2H, layer, mb, deps=[attn.id])
    return OffloadedAttention(pre, attn, store, f.node(Op.POST_ATTN, gpu, layer, mb, deps=[attn.id]))


def kept_sequences(share: float, sequences: int) -> int:
    """Of a micro-batch's `sequences` cache slots, the whole sequences every CPU-homed cache layer
    keeps on the GPU at a policy's kv_gpu_share: ⌊share × sequences⌋, as FlexGen rounds its cache's
    GPU segment down to whole sequences (flexgen/pytorch_backend.py, `init_cache_one_gpu_batch`:
    `int(shape[SEG_DIM] * cache_gpu_percent / 100) // num_head * num_head` of batch × heads)."""
    return int(share * sequences + 1e-9)


def kv_transfer(
    f: NodeFactory,
    op: Op,
    layer: int,
    mb: MicroBatchShape,
    deps: Sequence[int | None],
    kept: int = 0,
    pageable: bool = False,
) -> TaskNode:
    """KV_LOAD (h2d) or KV_STORE (d2h) of a micro-batch's cache layer whose first `kept` sequences
    stay on the GPU (the schedule's `kv_gpu_sequences`): only the others cross the link,
    round(bytes x (n - kept) / n)."""
    lane = Lane.GPU_H2D if op is Op.KV_LOAD else Lane.GPU_D2H
    node = f.node(op, lane, layer, mb, deps=deps, pageable=pageable)
    return evolve(node, bytes=round(node.bytes * (1 - Fraction(kept, mb.sequences)))) if kept else node


def layer_tail(
    f: NodeFactory, spec: ModelSpec, layer: int, mb: MicroBatchShape, post: int, experts: Sequence[int]
) -> list[TaskNode]:
    """[SHARED_FFN] then COMBINE after POST_ATTN and every expert output (`experts`: their last nodes)."""
    nodes = []
    if needs_shared(spec, layer):
        nodes.append(f.node(Op.SHARED_FFN, Lane.GPU_COMPUTE, layer, mb, deps=[post]))
    outputs = [*experts, *(n.id for n in nodes)]
    nodes.append(f.node(Op.COMBINE, Lane.GPU_COMPUTE, layer, mb, deps=[post, *outputs]))
    return nodes


def cpu_experts(
    f: NodeFactory,
    layer: int,
    mb: MicroBatchShape,
    gate: int,
    counts: Sequence[tuple[int, int]],
    offload: TaskNode | None = None,
) -> list[TaskNode]:
    """Experts computed on the CPU: HIDDEN_OFFLOAD (unless `offload`, one already emitted, brings
    the hidden states), one EXPERT_FFN per (expert, tokens) on cpu.compute, then one EXPERT_LOAD of
    every output (the last node). Empty if `counts` is."""
    if not counts:
        return []
    fresh = [] if offload else [f.node(Op.HIDDEN_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[gate])]
    source = offload or fresh[0]
    ffns = [
        f.node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, layer, mb, e, deps=[source.id], tokens=n) for e, n in counts
    ]
    load = f.node(Op.EXPERT_LOAD, Lane.GPU_H2D, layer, mb, deps=[ffn.id for ffn in ffns])
    return [*fresh, *ffns, load]


def routing_of(request: RoutingRequest) -> SubPlan[ExpertCounts]:
    """Yield a routing request; returns the routing the driver answers it with (a plan is sent None
    after a node, the ExpertCounts after a request)."""
    counts = yield request
    if counts is None:
        raise PlanError(f"routing request for layer {request.layer}, micro-batch {request.mb} not answered")
    return counts


def gate_and_route(
    f: NodeFactory, layer: int, mb: MicroBatchShape, post: int, defer: int = 0
) -> SubPlan[tuple[int, ExpertCounts]]:
    """GATE after POST_ATTN, then the routing request (`defer`: its Expert Deferral, see
    RoutingRequest); returns (gate id, ExpertCounts)."""
    gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[post])
    yield gate
    counts = yield from routing_of(RoutingRequest(layer, mb.index, gate.id, defer=defer))
    return gate.id, counts


def copied_experts(
    f: NodeFactory, layer: int, mb: MicroBatchShape, post: int, copies: Mapping[int, int]
) -> SubPlan[list[int]]:
    """GATE, then every routed expert's FFN on the GPU, each after the PAGE_COPY that brought it
    in (`copies`: expert -> copy id; none for a resident expert). Returns the FFN ids."""
    gate, counts = yield from gate_and_route(f, layer, mb, post)
    ffns = [
        f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, copies.get(e)], tokens=n)
        for e, n in counts.counts
    ]
    yield from ffns
    return [ffn.id for ffn in ffns]


def copy_experts(
    f: NodeFactory, layer: int, experts: Iterable[int]
) -> Generator[TaskNode, None, dict[int, int]]:
    """PAGE_COPY of each expert of `layer` -> {expert: copy id}."""
    copies: dict[int, int] = {}
    for expert in experts:
        copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=expert)
        yield copy
        copies[expert] = copy.id
    return copies


def evict_experts(f: NodeFactory, layer: int, experts: Iterable[int], after: Sequence[int]) -> list[TaskNode]:
    """EVICT each expert once every node of `after` (the layer's combines) is done; on the copy lane,
    ahead of the copies that reuse the buffer."""
    return [f.node(Op.EVICT, Lane.GPU_H2D, layer, expert=expert, deps=after) for expert in experts]


ExpertsPlan = Callable[[int, MicroBatchShape, int], SubPlan[list[int]]]


def model_order(
    f: NodeFactory,
    spec: ModelSpec,
    step: StepShape,
    experts: ExpertsPlan,
    after_layer: Callable[[int], PlanStream] | None = None,
) -> PlanStream:
    """Layer after layer, micro-batch after micro-batch, on the GPU, in model order;
    `experts(layer, mb, post)` plans an MoE layer's experts and returns their output nodes;
    `after_layer(layer)`, if given, plans what follows a layer's last micro-batch."""
    nodes, last = embeddings(f, step)
    yield from nodes
    for layer in range(spec.layers):
        for mb in step.micro_batches:
            attention = gpu_attention(f, layer, mb, last[mb.index])
            yield from attention
            post = attention[-1].id
            outputs = (yield from experts(layer, mb, post)) if spec.is_moe_layer(layer) else []
            tail = layer_tail(f, spec, layer, mb, post, outputs)
            yield from tail
            last[mb.index] = tail[-1].id
        if after_layer is not None:
            yield from after_layer(layer)
    yield from lm_heads(f, step, last)


def lm_heads(f: NodeFactory, step: StepShape, last: dict[int, int]) -> list[TaskNode]:
    return [f.node(Op.LM_HEAD, Lane.GPU_COMPUTE, mb=mb, deps=[last[mb.index]]) for mb in step.micro_batches]


def kept_per_layer(
    spec: ModelSpec, popularity: Sequence[Sequence[float]] | None, share: float
) -> dict[int, tuple[list[int], list[int]]]:
    """For each MoE layer, (its `share` most popular experts, the rest), most popular first."""
    ranked = popularity_ranking(spec, popularity)
    keep = round(share * spec.moe.experts)
    split = {}
    for m in moe_layers(spec):
        order = [e for layer, e in ranked if layer == m]
        split[m] = (order[:keep], order[keep:])
    return split


def popularity_ranking(
    spec: ModelSpec, popularity: Sequence[Sequence[float]] | None
) -> list[tuple[int, int]]:
    """Every (layer, expert) of the MoE layers, most popular first (uniform without a profile:
    expert 0 of every layer, then expert 1, ...)."""
    if popularity is not None and (
        len(popularity) != spec.layers or any(len(row) != spec.moe.experts for row in popularity)
    ):
        raise ConfigError(f"expert popularity must have {spec.layers} rows of {spec.moe.experts} shares")

    def share(layer: int, expert: int) -> float:
        return popularity[layer][expert] if popularity is not None else 0.0

    pairs = [(layer, e) for layer in moe_layers(spec) for e in range(spec.moe.experts)]
    return sorted(pairs, key=lambda p: (-share(*p), p[1], p[0]))
