"""Node builders the pipeline schedulers share (cgopipe, klotski, fiddler, lru-cache).

The pieces every plan has in the same shape whatever the schedule: embeddings,
attention on the GPU, a layer's tail (shared expert or dense MLP, then combine),
experts computed on the CPU next to their weights, the LM head; plus the latency
model a scheduler prices its choices with and the popularity ranking of experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec

Cost = Callable[[TaskNode], float]
DEFAULT_HARDWARE = "t4"


def latency_model(context: SchedulerContext) -> Cost:
    """The context's cost function, else the roofline of the default hardware preset."""
    return context.cost or RooflineCost(hardware(DEFAULT_HARDWARE))


def needs_shared(spec: ModelSpec, layer: int) -> bool:
    """SHARED_FFN runs on dense layers (their MLP) and on MoE layers of families with shared experts."""
    return not spec.is_moe_layer(layer) or spec.moe.has_shared


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
    f: NodeFactory, layer: int, mb: MicroBatchShape, gate: int, counts: Sequence[tuple[int, int]]
) -> list[TaskNode]:
    """Experts computed on the CPU: HIDDEN_OFFLOAD, one EXPERT_FFN per (expert, tokens) on
    cpu.compute, then one EXPERT_LOAD of every output (the last node). Empty if `counts` is."""
    if not counts:
        return []
    offload = f.node(Op.HIDDEN_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[gate])
    ffns = [
        f.node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, layer, mb, e, deps=[offload.id], tokens=n) for e, n in counts
    ]
    load = f.node(Op.EXPERT_LOAD, Lane.GPU_H2D, layer, mb, deps=[ffn.id for ffn in ffns])
    return [offload, *ffns, load]


def lm_heads(f: NodeFactory, step: StepShape, last: dict[int, int]) -> list[TaskNode]:
    return [f.node(Op.LM_HEAD, Lane.GPU_COMPUTE, mb=mb, deps=[last[mb.index]]) for mb in step.micro_batches]


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
