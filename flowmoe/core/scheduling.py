"""The scheduler contract: what a scheduler is told about a step and how it emits nodes.

A scheduler is pure: no torch, no asyncio. For each step it returns a plan, a
generator that yields TaskNodes in launch order and RoutingRequests when it
needs a layer's routing; the driver sends the ExpertCounts back into the
generator. NodeFactory numbers nodes across a whole run and fills in each
node's bytes and flops from the model spec, so every scheduler costs the same
op the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Sequence
from typing import ClassVar, Protocol

from attrs import define, field, frozen

from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import ExpertFormat, Policy
from flowmoe.core.spec import ModelSpec

PlanStream = Generator[TaskNode | RoutingRequest, ExpertCounts | None, None]
FP8_BLOCK = (128, 128)  # weight_block_size of the DeepSeek-V3, Kimi K2 and Qwen3-FP8 releases


def fp8_expert_bytes(spec: ModelSpec, block: tuple[int, int] = FP8_BLOCK) -> int:
    """One routed expert as an FP8 checkpoint stores it: a byte per weight of its three projections
    (gate and up [I, hidden], down [hidden, I]), a float32 scale per block of each (the edge
    blocks partial), and its biases, if any, in the model's dtype."""
    h, i = spec.hidden, spec.moe.intermediate
    scales = 2 * -(-i // block[0]) * -(-h // block[1]) + -(-h // block[0]) * -(-i // block[1])
    return 3 * h * i + 4 * scales + (spec.expert_params - 3 * h * i) * spec.dtype_bytes


@frozen
class MicroBatchShape:
    """What one micro-batch brings to a step."""

    index: int
    sequences: int
    tokens: int  # new tokens this step
    kv_tokens: int  # tokens in its KV cache after this step (all sequences)
    attended: int  # (query, key) pairs attention computes this step

    @classmethod
    def from_lengths(cls, index: int, counts: Sequence[int], past: Sequence[int]) -> MicroBatchShape:
        kv = [p + c for p, c in zip(past, counts, strict=True)]
        attended = sum(c * k for c, k in zip(counts, kv, strict=True))
        return cls(index, len(counts), sum(counts), sum(kv), attended)


@frozen
class StepShape:
    step: int
    prefill: bool
    micro_batches: tuple[MicroBatchShape, ...]

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.micro_batches)


@frozen
class Residency:
    """Weights a scheduler keeps on the GPU from the start: dense parts of layers, and experts."""

    dense: frozenset[int] = frozenset()
    experts: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def everything(cls, spec: ModelSpec) -> Residency:
        experts = {
            (layer, e)
            for layer in range(spec.layers)
            if spec.is_moe_layer(layer)
            for e in range(spec.moe.experts)
        }
        return cls(frozenset(range(spec.layers)), frozenset(experts))

    @classmethod
    def dense_only(cls, spec: ModelSpec) -> Residency:
        return cls(frozenset(range(spec.layers)), frozenset())


class Scheduler(Protocol):
    name: ClassVar[str]
    summary: ClassVar[str]

    def __init__(self, context: SchedulerContext) -> None: ...

    def residency(self) -> Residency:
        """What is on the GPU before the first step."""
        ...

    def weight_buffer_bytes(self) -> int:
        """The most weight bytes it has copied in beyond its residency at any moment."""
        ...

    def kv_on_gpu(self) -> bool:
        """Whether the KV cache lives on the GPU (else on the CPU, loaded or attended there)."""
        ...

    def plan(self, step: StepShape) -> PlanStream:
        """Nodes of one step (all layers, all micro-batches) in launch order."""
        ...


def kv_gpu_layers(scheduler: Scheduler, layers: int) -> frozenset[int]:
    """The layers whose KV cache lives on the GPU: the scheduler's own `kv_gpu_layers()` where it
    splits the cache by layer (Klotski keeps its first layers' caches on the GPU), else all of them
    or none, as `kv_on_gpu()` says."""
    split = getattr(scheduler, "kv_gpu_layers", None)
    if split is not None:
        return frozenset(split())
    return frozenset(range(layers)) if scheduler.kv_on_gpu() else frozenset()


def kv_gpu_sequences(scheduler: Scheduler) -> Callable[[int], int] | None:
    """Where a scheduler splits every CPU-homed cache layer by sequence (FlexGen's cache GPU percent),
    its own `kv_gpu_sequences`: of a micro-batch's `sequences` cache slots, how many whole sequences
    the GPU keeps in every such layer (the rest crosses the link); else None."""
    return getattr(scheduler, "kv_gpu_sequences", None)


def kv_gpu_parts(scheduler: Scheduler, layers: int, sequences: int) -> int:
    """How many of the `layers` x `sequences` (layer, sequence) caches of a micro-batch of `sequences`
    sequences live on the GPU: every sequence of its GPU-homed layers (`kv_gpu_layers`), and in each
    other layer the sequences the scheduler keeps there (`kv_gpu_sequences`)."""
    gpu_layers = len(kv_gpu_layers(scheduler, layers))
    kept = kv_gpu_sequences(scheduler)
    return gpu_layers * sequences + (layers - gpu_layers) * (kept(sequences) if kept else 0)


def kv_working_bytes(scheduler: Scheduler, spec: ModelSpec, sequences: int, max_len: int) -> int:
    """The most GPU bytes the working copies of CPU-homed cache layers (KV_LOAD) take at once, for
    `sequences` sequences of up to `max_len` tokens: the scheduler's own `kv_working_bytes` where its
    plan bounds them (MoE-Gen's KV buffers), else two layers' caches of the whole batch."""
    own = getattr(scheduler, "kv_working_bytes", None)
    if own is not None:
        return own(sequences, max_len)
    return 2 * sequences * max_len * spec.kv_bytes_per_token // spec.layers


@frozen
class SchedulerContext:
    """What a scheduler is built with. `cost(node)` estimates seconds (the cost model, or a
    calibrated profile); `popularity[layer][expert]` is a routing profile's token share;
    `weights_pinned`: the CPU copies of the weights are page-locked (flowmoe's runtime pins them), so
    a page goes to the GPU directly; where not (a simulation of a system that stages them), a
    schedule that stages pages through pinned buffers issues that CPU-side copy (W_STAGE);
    `host_weight_bytes`: host memory left for the weights the GPU does not keep (None: unlimited),
    past which a schedule with a disk tier reads weights from disk (DISK_LOAD)."""

    spec: ModelSpec
    policy: Policy
    factory: NodeFactory
    cost: Callable[[TaskNode], float] | None = None
    popularity: tuple[tuple[float, ...], ...] | None = None
    weights_pinned: bool = True
    host_weight_bytes: int | None = None


@define
class NodeFactory:
    """Makes the nodes of a run: unique ids, and bytes/flops of each op from the spec."""

    spec: ModelSpec
    _ids: itertools.count = field(factory=itertools.count)
    expert_format: ExpertFormat = "native"  # the policy's: how an expert's PAGE_COPY crosses the link

    def node(
        self,
        op: Op,
        lane: Lane,
        layer: int = -1,
        mb: MicroBatchShape | None = None,
        expert: int = -1,
        deps: Sequence[int | None] = (),
        tokens: int | None = None,
        part: int = -1,
        parts: int = 1,
        pageable: bool = False,
        sync: bool = False,
        more: Sequence[int] = (),
        serves: Sequence[int] = (),
    ) -> TaskNode:
        """`tokens`: tokens an expert FFN processes (default: the micro-batch's tokens).
        `part`/`parts`: a PAGE_COPY of page `part` of `parts` (its bytes are that page's share);
        `more`: a PAGE_COPY of whole experts, `expert` and these after it, as one page.
        `pageable`: a copy whose host side is not pinned; `sync`: the host waits for this node.
        `serves`: the micro-batches whose tokens an EXPERT_FFN's one GEMM takes (TaskNode.serves); the
        node is priced by its `tokens` all the same.
        `None` deps are dropped, so optional producers can be passed as is."""
        clean = tuple(dict.fromkeys(d for d in deps if d is not None))
        n_bytes, flops = self._cost(op, layer, mb, expert, tokens)
        if part >= 0:
            n_bytes = n_bytes * (part + 1) // parts - n_bytes * part // parts
            flops = flops * (part + 1) // parts - flops * part // parts
        n_bytes, flops = n_bytes * (1 + len(more)), flops * (1 + len(more))
        index = mb.index if mb else -1
        rowless = flops == 0 and op is not Op.COMBINE  # COMBINE: no GEMM, but its rows are all-reduced (TP)
        rows = 0 if rowless else (mb.sequences if op is Op.LM_HEAD and mb else tokens if tokens is not None
                                  else mb.tokens if mb else 0)  # fmt: skip
        return TaskNode(next(self._ids), op, lane, layer, index, expert, clean, n_bytes, flops, part, parts,
                        rows, pageable, sync, tuple(more), tuple(serves))  # fmt: skip

    def _cost(
        self, op: Op, layer: int, mb: MicroBatchShape | None, expert: int, tokens: int | None
    ) -> tuple[int, int]:
        """-> (bytes moved or read, flops): weights read once, activations per token."""
        s, a, b = self.spec, self.spec.attention, self.spec.dtype_bytes
        t = mb.tokens if mb else 0
        q, kv, out = a.q_width, a.kv_width, a.out_width
        if op in (Op.PAGE_COPY, Op.W_STAGE) and expert >= 0 and self.expert_format == "fp8":
            fp8 = fp8_expert_bytes(s)  # a copy's flops: the multiply per weight of its dequantization
            return (fp8, 3 * s.hidden * s.moe.intermediate) if op is Op.PAGE_COPY else (2 * fp8, 0)
        if op in (Op.PAGE_COPY, Op.EVICT):
            return (s.expert_bytes if expert >= 0 else s.layer_dense_bytes(layer)), 0
        if op is Op.DISK_LOAD:  # a whole layer's weights
            return s.layer_dense_bytes(layer) + s.layer_expert_bytes(layer), 0
        if op is Op.W_STAGE:  # a memcpy: every byte read and written once
            return 2 * (s.expert_bytes if expert >= 0 else s.layer_dense_bytes(layer)), 0
        if op in (Op.EXPERT_FFN, Op.SHARED_FFN):
            inter = s.moe.intermediate if op is Op.EXPERT_FFN else self._shared_inter(layer)
            n = t if tokens is None else tokens
            return 3 * s.hidden * inter * b + 2 * n * s.hidden * b, 6 * n * s.hidden * inter
        if op in (Op.CPU_ATTN, Op.GPU_ATTN):
            kv_tokens, attended = (mb.kv_tokens, mb.attended) if mb else (0, 0)
            return kv_tokens * 2 * kv * b + t * (q + out) * b, attended * a.pair_flops()
        if op in (Op.KV_LOAD, Op.KV_STORE):  # load: the tokens cached before this step; store: its new ones
            cached = (mb.kv_tokens - t if mb else 0) if op is Op.KV_LOAD else t
            return cached * 2 * kv * b, 0
        if op is Op.LM_HEAD:
            rows = mb.sequences if mb else 0
            return s.vocab * s.hidden * b + rows * s.hidden * b, 2 * rows * s.hidden * s.vocab
        params = {
            Op.PRE_ATTN: a.pre_params(s.hidden),
            Op.POST_ATTN: out * s.hidden,
            Op.GATE: s.moe.experts * s.hidden,
            Op.PREGATE: s.moe.experts * s.hidden,
        }.get(op, 0)
        activations = {
            Op.EMBED: s.hidden,
            Op.PRE_ATTN: s.hidden + q + 2 * kv,
            Op.POST_ATTN: out + 2 * s.hidden,
            Op.GATE: s.hidden,
            Op.PREGATE: s.hidden,
            Op.QKV_OFFLOAD: q + 2 * kv,
            Op.HIDDEN_LOAD: out,
            Op.HIDDEN_OFFLOAD: s.hidden,
            Op.ACT_STORE: s.hidden,
            Op.ACT_LOAD: s.hidden,
            Op.EXPERT_LOAD: s.hidden,
            Op.COMBINE: s.hidden * (s.moe.top_k + 2),
        }[op]
        return params * b + t * activations * b, 2 * params * t

    def _shared_inter(self, layer: int) -> int:
        moe = self.spec.moe
        return moe.shared_intermediate if self.spec.is_moe_layer(layer) else moe.dense_intermediate
