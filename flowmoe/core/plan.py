"""Task nodes: what runs, on which lane, after what. Nodes hold no tensors.

A scheduler emits nodes in launch order and asks for a layer's routing when it
needs it (a `RoutingRequest`), so it can be driven by a real run (the gate's
output) or by a recorded routing trace alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from attrs import define, frozen


class Lane(StrEnum):
    """A per-device queue; nodes on one lane run one at a time in emission order."""

    GPU_COMPUTE = "gpu.compute"
    GPU_H2D = "gpu.h2d"
    GPU_D2H = "gpu.d2h"
    CPU_COMPUTE = "cpu.compute"
    CPU_STAGE = "cpu.stage"  # host memcpy threads beside cpu.compute (pageable -> pinned staging)
    DISK_READ = "disk.read"

    @property
    def device(self) -> str:
        return DEVICES[self]

    @property
    def on_gpu(self) -> bool:
        return self in GPU_LANES


# a lane's device, looked up: workers and the runtime ask for every node, and an enum member's `value`
# and `split` cost ~1 us a call
DEVICES: dict[Lane, str] = {lane: lane.value.split(".", 1)[0] for lane in Lane}
GPU_LANES = frozenset(lane for lane in Lane if DEVICES[lane] == "gpu")


class Op(StrEnum):
    EMBED = "embed"  # token ids -> hidden
    PRE_ATTN = "pre_attn"  # norm + QKV + rope
    QKV_OFFLOAD = "qkv_offload"  # q, k, v: GPU -> CPU (attention on the CPU)
    CPU_ATTN = "cpu_attn"
    GPU_ATTN = "gpu_attn"
    KV_LOAD = "kv_load"  # a micro-batch's KV cache: CPU -> GPU (FlexGen)
    KV_STORE = "kv_store"  # the KV cache back: GPU -> CPU
    HIDDEN_LOAD = "hidden_load"  # attention output: CPU -> GPU
    ACT_STORE = "act_store"  # a micro-batch's residual stream (the layer's activations): GPU -> CPU
    ACT_LOAD = "act_load"  # ... and back: CPU -> GPU (FlexGen with activations on the CPU)
    POST_ATTN = "post_attn"  # O projection + residual + norm
    GATE = "gate"  # router: top-k experts of each token
    PREGATE = "pregate"  # next layer's router on this layer's hidden state (speculative)
    EXPERT_FFN = "expert_ffn"  # one routed expert, on the lane's device
    HIDDEN_OFFLOAD = "hidden_offload"  # activations GPU -> CPU for a CPU expert
    EXPERT_LOAD = "expert_load"  # a CPU expert's output back to the GPU
    SHARED_FFN = "shared_ffn"  # shared expert, or the dense MLP of a dense layer
    COMBINE = "combine"  # residual + weighted expert outputs
    DISK_LOAD = "disk_load"  # a layer's host-homed weights: disk -> CPU memory (simulated only)
    W_STAGE = "w_stage"  # a weight page: pageable CPU memory -> pinned buffer (CPU memcpy; simulated only)
    PAGE_COPY = "page_copy"  # weights: CPU (pinned) -> GPU; expert -1 = a layer's dense weights
    EVICT = "evict"  # free a GPU weight buffer
    LM_HEAD = "lm_head"  # final norm + logits
    # a whole decoder layer in model order on one lane (pre-attention, attention, post-attention, router,
    # experts, combine): the `cpu` schedule's node, where finer nodes have nothing to overlap
    LAYER = "layer"


# Not frozen, though never changed once made (derive one with attrs.evolve): a frozen attrs class sets
# each field through object.__setattr__, ~5 us a node of these 19 fields against ~1 us, a third of the
# runtime's own host work per decode step (issue 25). Equal and hashed by value as a frozen one is.
@define(slots=True, unsafe_hash=True)
class TaskNode:
    """One step of one layer for one micro-batch (and expert), with its cost figures."""

    id: int
    op: Op
    lane: Lane
    layer: int = -1
    mb: int = -1
    expert: int = -1
    deps: tuple[int, ...] = ()
    bytes: int = 0  # bytes moved (copies) or read (compute)
    flops: int = 0
    part: int = -1  # PAGE_COPY: page index within the expert (or dense part) being copied
    parts: int = 1  # PAGE_COPY: pages that expert is copied in
    pages: int = 1  # PAGE_COPY: pages `part`, `part` + 1, ... it copies (its scheduler's run, or page_runs')
    rows: int = 0  # tokens (GEMM rows) a compute node processes; the cost model's GEMM efficiency
    pageable: bool = False  # a copy from (or to) pageable host memory, not pinned
    sync: bool = False  # the host waits for this node before it issues more (a synchronisation point)
    more: tuple[int, ...] = ()  # PAGE_COPY of whole experts: the experts after `expert` in one page
    # EXPERT_FFN: one GEMM of its expert over the tokens of these micro-batches, in order, in chunks of
    # `rows` (MoE-Gen's expert batch): the node of the first runs it, each other's finds its output
    # there; empty: its own micro-batch's tokens, in one kernel call with other experts at hand
    serves: tuple[int, ...] = ()
    # EXPERT_FFN, EXPERT_LOAD: the layer whose COMBINE (of the node's micro-batch) adds the expert output
    # (-1: the node's own layer; KTransformers' Expert Deferral names the next layer's)
    combined_at: int = -1

    @property
    def experts(self) -> tuple[int, ...]:
        """Every expert the node concerns (several for a PAGE_COPY of a chunk of experts)."""
        return (self.expert, *self.more) if self.expert >= 0 else ()

    @property
    def combine_layer(self) -> int:
        """The layer whose COMBINE adds this expert node's output (`combined_at`, else its own)."""
        return self.layer if self.combined_at < 0 else self.combined_at

    @property
    def label(self) -> str:
        """`op L3 mb1 e5`: the name used in traces, errors and profiler ranges."""
        parts = [str(self.op)]
        if self.layer >= 0:
            parts.append(f"L{self.layer}")
        if self.mb >= 0:
            parts.append(f"mb{self.mb}")
        if self.expert >= 0:
            parts.append("+".join(f"e{e}" for e in self.experts))
        if self.part >= 0:
            last = f"-{self.part + self.pages - 1}" if self.pages > 1 else ""
            parts.append(f"p{self.part}{last}/{self.parts}")
        return " ".join(parts)


@frozen
class RoutingRequest:
    """Yielded by a scheduler: 'how many tokens go to each expert at (layer, mb)?'

    The driver answers once node `after` is done (the gate, or a pre-gate), with
    `ExpertCounts`."""

    layer: int
    mb: int
    after: int
    speculative: bool = False  # a pre-gate's prediction rather than the gate's decision
    # KTransformers' Expert Deferral: the layer adds the experts no token places among its top_k - defer
    # heaviest into the next layer's combine instead of its own (0: none); the answer's `ranks` say which
    defer: int = 0


def deferred_by_rank(ranks: Iterable[tuple[int, int]], keep: int) -> tuple[int, ...]:
    """Experts no token places among its `keep` heaviest, from (expert, best rank) pairs: what
    KTransformers' Expert Deferral defers when it keeps `keep` = top_k - K experts of each token
    (kt-kernel's rule: an expert one token keeps runs at once for all its tokens). The one rule the
    scheduler, the runtime and the eager reference (MoEModel.deferred_experts) share."""
    return tuple(e for e, rank in ranks if rank >= keep)


@frozen
class ExpertCounts:
    """The answer to a RoutingRequest: tokens routed to each expert with any, ascending."""

    layer: int
    mb: int
    counts: tuple[tuple[int, int], ...]  # (expert, tokens)
    # (expert at the previous MoE layer, expert here, tokens that took both): the per-token paths,
    # where the routing source has them (synthetic routing); empty otherwise
    follows: tuple[tuple[int, int, int], ...] = ()
    # (expert, rank): the best place any of its tokens gave it among that token's top-k, heaviest
    # routing weight first (0: some token's heaviest), where the routing source has it; empty otherwise
    ranks: tuple[tuple[int, int], ...] = ()

    @property
    def experts(self) -> tuple[int, ...]:
        return tuple(e for e, _ in self.counts)

    def deferrable(self, keep: int) -> tuple[int, ...]:
        """Expert Deferral's choice from this answer's ranks (`deferred_by_rank`)."""
        return deferred_by_rank(self.ranks, keep)

    def tokens(self, expert: int) -> int:
        return dict(self.counts).get(expert, 0)
