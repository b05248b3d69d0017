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
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, ClassVar, TypeVar, cast

from attrs import define, field, frozen

from flowmoe.core.errors import PlanError
from flowmoe.core.expert_formats import attention_projections, dense_layer_bytes, packed_expert_bytes
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.options import NoOptions
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import AttentionFormat, ExpertFormat, Place, Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import Workload

PlanStream = Generator[TaskNode | RoutingRequest, ExpertCounts | None, None]
R = TypeVar("R")
# part of a plan, run with `yield from`, that returns an R (node ids, a layer's routing, ...)
SubPlan = Generator[TaskNode | RoutingRequest, ExpertCounts | None, R]
WEIGHT_OPS = frozenset({Op.PAGE_COPY, Op.W_STAGE, Op.EVICT, Op.DISK_LOAD})  # nodes priced by weights alone
BY_LAYER = WEIGHT_OPS | {Op.SHARED_FFN}  # ops whose rate depends on their layer (NodeFactory._rate)


class WrappedPlan(Generator[TaskNode | RoutingRequest, ExpertCounts | None, None]):
    """A plan stream round another (`plan`): a subclass's `send` checks or counts its items; a fault
    thrown in and the close go straight to `plan`."""

    plan: PlanStream

    def throw(
        self, typ: Any, val: Any = None, tb: TracebackType | None = None
    ) -> TaskNode | RoutingRequest:  # Any: Generator.throw's two overloads, (type, value) and (exception)
        return self.plan.throw(typ, val, tb)

    def close(self) -> None:
        self.plan.close()


@frozen
class NodeBudget:
    """The most nodes one step's plan may emit, and what to say when a plan goes past it."""

    limit: int
    refusal: str

    def refused(self) -> PlanError:
        """The error of a plan that emitted a node past the limit."""
        return PlanError(f"{self.refusal} (more than {self.limit} nodes in one step)")


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


@frozen
class BatchShape:
    """The largest batch a run holds at once: its prompt lengths micro-batch by micro-batch and the
    new tokens each sequence gets. What the runtime's memory check, the simulator, the planner and
    bench/gpu.py all size memory from (`core.memory`)."""

    prompts: tuple[tuple[int, ...], ...]  # prompt lengths, micro-batch by micro-batch
    gen: int  # new tokens per sequence
    pool: bool = False  # the cache is a token pool (each sequence's own tokens), not one rectangle

    @classmethod
    def of(cls, prompts: Sequence[int], micro_batch: int, gen: int, pool: bool = False) -> BatchShape:
        """`prompts` in micro-batches of `micro_batch`, in order."""
        groups = (tuple(prompts[i : i + micro_batch]) for i in range(0, len(prompts), micro_batch))
        return cls(tuple(groups), gen, pool)

    def slots(self, index: int) -> int:
        """KV cache token slots of micro-batch `index`: a [sequences, longest + gen] rectangle (the
        engine's cache), or each sequence's own tokens (a token pool)."""
        g = self.prompts[index]
        return sum(g) + len(g) * self.gen if self.pool else len(g) * (max(g) + self.gen)

    @property
    def total_slots(self) -> int:
        return sum(self.slots(i) for i in range(len(self.prompts)))

    def steps(self) -> tuple[StepShape, ...]:
        """The steps a run's memory peaks at: the prefill (the most tokens) and the last decode step
        (the longest contexts)."""
        groups = list(enumerate(self.prompts))
        prefill = StepShape(
            0, True, tuple(MicroBatchShape.from_lengths(i, g, [0] * len(g)) for i, g in groups)
        )
        if self.gen < 2:
            return (prefill,)
        last = tuple(
            MicroBatchShape.from_lengths(i, [1] * len(g), [p + self.gen - 2 for p in g]) for i, g in groups
        )
        return prefill, StepShape(self.gen - 1, False, last)


@frozen
class PolicyRequest:
    """What a scheduler's own planner is asked (`Scheduler.own_policies`): policies for this model,
    machine and workload, one per attention placement in `attention`, N at most `max_batch` where
    given, within `gpu_memory` (None: the device's)."""

    spec: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    attention: tuple[Place, ...]
    max_batch: int | None = None
    gpu_memory: int | None = None


class Scheduler(ABC):
    """The base of every scheduler plugin. A subclass names itself (`name`, a one-line `summary`),
    must say what the GPU holds from the start (`residency`) and plan each step (`plan`); every
    other capability below has a default body that fits a schedule keeping the whole KV cache on
    the GPU, with no working buffers, no disk tier and nothing to report. `core.memory` sizes a
    run's GPU and host memory from these answers alone, for the runtime and the simulator alike."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Options: ClassVar[type] = NoOptions  # its knobs (core.options): flags, search, policy.options_for

    @classmethod
    def own_policies(cls, request: PolicyRequest) -> Sequence[Policy]:
        """The policies its own planner chooses for a setup, which the best-policy search tries
        besides its grid. None by default (MoE-Gen has one)."""
        return ()

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context

    @abstractmethod
    def residency(self) -> Residency:
        """What is on the GPU before the first step."""

    @abstractmethod
    def plan(self, step: StepShape) -> PlanStream:
        """Nodes of one step (all layers, all micro-batches) in launch order."""

    def weight_buffer_bytes(self) -> int:
        """The most weight bytes it has copied in beyond its residency at any moment."""
        return 0

    def uses_gpu(self) -> bool:
        """Whether it computes on the GPU at all: the embedding and LM head then live there, and a
        step's activations. False: a CPU-only schedule, of whose run the GPU holds nothing."""
        return True

    def kv_on_gpu(self) -> bool:
        """Whether the KV cache lives on the GPU (else on the CPU, loaded or attended there)."""
        return True

    def kv_gpu_layers(self) -> frozenset[int]:
        """The layers whose KV cache lives on the GPU: all of them or none, as `kv_on_gpu()` says
        (Klotski keeps its first layers' caches there)."""
        return frozenset(range(self.context.spec.layers)) if self.kv_on_gpu() else frozenset()

    def kv_gpu_sequences(self, sequences: int) -> int:
        """Of a micro-batch's `sequences` cache slots, how many whole sequences the GPU keeps in every
        CPU-homed cache layer (FlexGen's cache GPU percent splits the cache so); the rest crosses the
        link. Must not grow faster than `sequences`."""
        return 0

    def kv_working_bytes(self, batch: BatchShape, step: StepShape) -> int:
        """The most GPU bytes the working copies of CPU-homed cache layers (KV_LOAD) take at once in
        `step` of `batch`: a micro-batch's slice of one layer being attended and the next one loading,
        two slices of the largest (sequences x the longest context after the step, as the runtime
        copies them); none where attention runs on the CPU beside the cache. A plan that keeps more
        or other copies says so (MoE-Gen's KV buffers). Counted only where some layer's cache is
        homed on the CPU."""
        if self.context.policy.attention_on == "cpu":
            return 0
        spec = self.context.spec
        longest = max(len(g) * (max(g) + step.step) for g in batch.prompts)  # step 0: the prompts
        return 2 * longest * spec.kv_bytes_per_token // spec.layers

    def gpu_working_bytes(self, step: StepShape) -> int:
        """GPU buffers of the plan's own in `step` beyond its weights, weight buffers, KV cache and
        working copies, and one micro-batch's activations (MoE-Gen's expert groups' tokens)."""
        return 0

    def disk_tier(self) -> bool:
        """Whether weights the host memory cannot hold are read from disk (DISK_LOAD on disk.read)."""
        return False

    def report(self) -> dict[str, float]:
        """Figures of the run so far for its report (an expert cache's hit rate, …), by name."""
        return {}


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


@frozen(slots=True)
class Rate:
    """An op's cost, linear in what its micro-batch brings to the step: bytes moved or read and flops,
    each a fixed part (its weights) plus so much per new token, per cached token, per (query, key)
    pair attended and per sequence."""

    bytes: int
    flops: int
    bytes_per_token: int = 0
    flops_per_token: int = 0
    bytes_per_cached: int = 0
    flops_per_pair: int = 0
    bytes_per_sequence: int = 0
    flops_per_sequence: int = 0
    own_tokens: bool = False  # priced by the tokens its node is given (an FFN's), not its micro-batch's


@define
class NodeFactory:
    """Makes the nodes of a run: unique ids, and bytes/flops of each op from the spec."""

    spec: ModelSpec
    _ids: itertools.count = field(factory=itertools.count)
    expert_format: ExpertFormat = "native"  # the policy's: how an expert's PAGE_COPY crosses the link
    attention_format: AttentionFormat = "native"  # the policy's: how a dense part's attention crosses it
    # what `_cost` works out once per (op, layer, expert's or dense): the op's cost as a `Rate`
    _rates: dict[tuple[Op, int, bool], Rate] = field(factory=dict, init=False, eq=False)
    # packed experts copied onto the GPU whose first use there, which dequantizes them, is still to come
    _arrived: set[tuple[int, int]] = field(factory=set, init=False, eq=False)
    # `_price`'s answers for the micro-batch `_mb`, by (op, layer where its rate depends on it, expert's
    # or dense, tokens): a step's layers share them
    _mb: MicroBatchShape | None = field(default=None, init=False, eq=False)
    _priced: dict[tuple[Op, int, bool, int | None], tuple[int, int, int, int]] = field(
        factory=dict, init=False, eq=False
    )

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
        pages: int = 1,
        pageable: bool = False,
        sync: bool = False,
        more: Sequence[int] = (),
        serves: Sequence[int] = (),
    ) -> TaskNode:
        """`tokens`: tokens an expert FFN processes (default: the micro-batch's tokens).
        `part`/`parts`: a PAGE_COPY of page `part` of `parts` (its bytes are that page's share);
        `pages`: of the pages `part` .. `part + pages - 1` together (their shares summed: a run);
        `more`: a PAGE_COPY of whole experts, `expert` and these after it, as one page.
        `pageable`: a copy whose host side is not pinned; `sync`: the host waits for this node.
        `serves`: the micro-batches whose tokens an EXPERT_FFN's one GEMM takes (TaskNode.serves); the
        node is priced by its `tokens` all the same.
        `None` deps are dropped, so optional producers can be passed as is."""
        only = deps[0] if len(deps) == 1 else None  # most nodes: one producer, nothing to drop or merge
        if only is not None:
            clean: tuple[int, ...] = (only,)
        else:  # in order, once each, the None dropped: no frame run per dep
            unique = dict.fromkeys(deps)
            unique.pop(None, None)
            clean = tuple(cast(dict[int, None], unique))
        if mb is not self._mb:  # what `_priced` worked out holds for one micro-batch's figures
            self._mb, self._priced = mb, {}
        # a LAYER's price depends on its layer only through whether it is an MoE layer (`_layer_cost`)
        by_layer = layer if op in BY_LAYER else -1 if op is not Op.LAYER else self.spec.is_moe_layer(layer)
        key = (op, by_layer, expert >= 0, tokens)
        priced = self._priced.get(key)
        if priced is None:
            priced = self._priced[key] = self._price(op, layer, mb, expert, tokens)
        n_bytes, flops, rows, index = priced
        if part >= 0:
            end = part + pages
            n_bytes = n_bytes * end // parts - n_bytes * part // parts
            flops = flops * end // parts - flops * part // parts
            if not flops and op is not Op.COMBINE:  # a page's share of a copy's flops rounded to none
                rows = 0
        if more:
            n_bytes, flops = n_bytes * (1 + len(more)), flops * (1 + len(more))
        if self.expert_format != "native" and expert >= 0 and lane.on_gpu:
            n_bytes, flops = self._dequantized_once(op, layer, (expert, *more), n_bytes, flops)
        return TaskNode(next(self._ids), op, lane, layer, index, expert, clean, n_bytes, flops, part, parts,
                        pages, rows, pageable, sync, tuple(more), tuple(serves))  # fmt: skip

    def _price(
        self, op: Op, layer: int, mb: MicroBatchShape | None, expert: int, tokens: int | None
    ) -> tuple[int, int, int, int]:
        """-> (bytes, flops, GEMM rows, micro-batch index) of a node of `op` for `mb` given `tokens`, its part
        and more aside."""
        n_bytes, flops = self._cost(op, layer, mb, expert, tokens)
        rowless = flops == 0 and op is not Op.COMBINE  # COMBINE: no GEMM, but its rows are all-reduced (TP)
        rows = 0 if rowless else (mb.sequences if op is Op.LM_HEAD and mb else tokens if tokens is not None
                                  else mb.tokens if mb else 0)  # fmt: skip
        return n_bytes, flops, rows, mb.index if mb else -1

    def _dequantized_once(
        self, op: Op, layer: int, experts: tuple[int, ...], n_bytes: int, flops: int
    ) -> tuple[int, int]:
        """A packed expert crosses packed and is dequantized at its first use on the GPU, on the compute
        stream (runtime/device_weights.py): that use's EXPERT_FFN also reads the packed bytes and writes
        the weights in the model's dtype, a flop a weight (as a copy's flops count them); a copy marks
        its experts as arrived, their first GPU FFN since pays it."""
        if op is Op.PAGE_COPY:
            self._arrived.update((layer, e) for e in experts)
        elif op is Op.EXPERT_FFN and (layer, experts[0]) in self._arrived:
            self._arrived.discard((layer, experts[0]))
            s = self.spec
            n_bytes += packed_expert_bytes(s, self.expert_format) + s.expert_bytes
            flops += 3 * s.hidden * s.moe.intermediate
        return n_bytes, flops

    def _cost(
        self, op: Op, layer: int, mb: MicroBatchShape | None, expert: int, tokens: int | None
    ) -> tuple[int, int]:
        """-> (bytes moved or read, flops): weights read once, activations per token."""
        if op is Op.LAYER:
            return self._layer_cost(layer, mb)
        key = (op, layer, expert >= 0)
        rate = self._rates.get(key)
        if rate is None:
            rate = self._rates[key] = self._rate(op, layer, expert)
        t, kv, pairs, seqs = (mb.tokens, mb.kv_tokens, mb.attended, mb.sequences) if mb else (0, 0, 0, 0)
        if tokens is not None and rate.own_tokens:
            t = tokens
        n_bytes = rate.bytes + t * rate.bytes_per_token + kv * rate.bytes_per_cached
        flops = rate.flops + t * rate.flops_per_token + pairs * rate.flops_per_pair
        return n_bytes + seqs * rate.bytes_per_sequence, flops + seqs * rate.flops_per_sequence

    def _layer_cost(self, layer: int, mb: MicroBatchShape | None) -> tuple[int, int]:
        """A LAYER's (bytes, flops): its parts' (PRE_ATTN, attention beside its cache, POST_ATTN; GATE,
        the routed experts and COMBINE on an MoE layer; SHARED_FFN where the layer has a shared expert
        or is dense). Its T tokens' T x top_k expert rows read the weights of the experts they pick,
        E (1 - (1 - top_k / E)^T) of them when each token picks top_k of the E at random (top_k at one
        token): the plan holds no routing to price them by."""
        spec, moe_layer = self.spec, self.spec.is_moe_layer(layer)
        parts = [Op.PRE_ATTN, Op.CPU_ATTN, Op.POST_ATTN]
        parts += [Op.GATE, Op.COMBINE] if moe_layer else []
        parts += [Op.SHARED_FFN] if not moe_layer or spec.moe.has_shared else []
        costs = [self._cost(op, layer, mb, -1, None) for op in parts]
        n_bytes, flops = sum(c[0] for c in costs), sum(c[1] for c in costs)
        if moe_layer and mb is not None:
            k, experts, tokens = spec.moe.top_k, spec.moe.experts, mb.tokens
            weights = self._cost(Op.EXPERT_FFN, layer, mb, 0, 0)[0]  # one expert's weights alone
            rows_bytes, rows_flops = self._cost(Op.EXPERT_FFN, layer, mb, 0, tokens * k)
            touched = experts * (1 - (1 - k / experts) ** tokens)
            n_bytes += rows_bytes - weights + round(touched * weights)
            flops += rows_flops
        return n_bytes, flops

    def _rate(self, op: Op, layer: int, expert: int) -> Rate:
        """What `_cost` prices `op` of `layer` (expert >= 0: an expert's) by."""
        if op in WEIGHT_OPS:  # a figure per layer and kind of weight
            return Rate(*self._weight_cost(op, layer, expert))
        s, a, b = self.spec, self.spec.attention, self.spec.dtype_bytes
        if op in (Op.EXPERT_FFN, Op.SHARED_FFN):  # priced by the tokens it is given
            inter = s.moe.intermediate if op is Op.EXPERT_FFN else self._shared_inter(layer)
            return Rate(3 * s.hidden * inter * b, 0, 2 * s.hidden * b, 6 * s.hidden * inter, own_tokens=True)
        if op in (Op.CPU_ATTN, Op.GPU_ATTN):  # the cache read, q in and the output out; every pair attended
            return Rate(0, 0, (a.q_width + a.out_width) * b, bytes_per_cached=2 * a.kv_width * b,
                        flops_per_pair=a.pair_flops())  # fmt: skip
        if op is Op.KV_LOAD:  # the tokens cached before this step
            return Rate(0, 0, -2 * a.kv_width * b, bytes_per_cached=2 * a.kv_width * b)
        if op is Op.KV_STORE:  # this step's new ones
            return Rate(0, 0, 2 * a.kv_width * b)
        if op is Op.LM_HEAD:  # the head's weights; each sequence's last row
            return Rate(s.vocab * s.hidden * b, 0, bytes_per_sequence=s.hidden * b,
                        flops_per_sequence=2 * s.hidden * s.vocab)  # fmt: skip
        params, activations = self._per_token()[op]
        return Rate(params * b, 0, activations * b, 2 * params)

    def _per_token(self) -> dict[Op, tuple[int, int]]:
        """Each op priced by its weights and tokens alone: (weights read, activation elements per token),
        weights 0 where it reads none."""
        s, a = self.spec, self.spec.attention
        q, kv, out = a.q_width, a.kv_width, a.out_width
        params = {
            Op.PRE_ATTN: a.pre_params(s.hidden),
            Op.POST_ATTN: out * s.hidden,
            Op.GATE: s.moe.experts * s.hidden,
            Op.PREGATE: s.moe.experts * s.hidden,
        }
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
        }
        return {op: (params.get(op, 0), n) for op, n in activations.items()}

    def _weight_cost(self, op: Op, layer: int, expert: int) -> tuple[int, int]:
        """`_cost` of a weight's copy, staging copy, eviction or disk read (expert >= 0: an expert's)."""
        s = self.spec
        if op in (Op.PAGE_COPY, Op.W_STAGE) and expert >= 0 and self.expert_format != "native":
            packed = packed_expert_bytes(s, self.expert_format)  # a copy's flops: a dequantized weight each
            return (packed, 3 * s.hidden * s.moe.intermediate) if op is Op.PAGE_COPY else (2 * packed, 0)
        if op in (Op.PAGE_COPY, Op.W_STAGE) and expert < 0 and self.attention_format != "native":
            dense = dense_layer_bytes(s, layer, self.attention_format)  # flops: its projections dequantized
            dequantized = sum(r * c for r, c in attention_projections(s))
            return (dense, dequantized) if op is Op.PAGE_COPY else (2 * dense, 0)
        if op in (Op.PAGE_COPY, Op.EVICT):
            return (s.expert_bytes if expert >= 0 else s.layer_dense_bytes(layer)), 0
        if op is Op.DISK_LOAD:  # a whole layer's weights
            return s.layer_dense_bytes(layer) + s.layer_expert_bytes(layer), 0
        return 2 * (s.expert_bytes if expert >= 0 else s.layer_dense_bytes(layer)), 0  # W_STAGE: a memcpy

    def _shared_inter(self, layer: int) -> int:
        moe = self.spec.moe
        return moe.shared_intermediate if self.spec.is_moe_layer(layer) else moe.dense_intermediate
