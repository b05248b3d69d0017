"""MoE-Lightning's Hierarchical Roofline Model (HRM): rooflines per memory level and across levels.

Each level i (GPU, CPU) has a compute roof P_i and a memory roof B_i; the
CPU->GPU link has a roof B_cg. An op x run at level i on data homed at level j
attains  P_x^i = min(P_i, B_i * I_x^i, B_ji * I_x^j)  where I_x^i is its
intensity (flop per byte) against level i's memory and I_x^j against the bytes
it pulls over the link. The turning points:

- the ridge of each level, P_i / B_i (memory bound below, compute bound above);
- P1 = P_cpu / B_cg: an op on data in CPU memory whose link intensity is below
  P1 is better computed on the CPU than moved to the GPU;
- P2 = P_kernel / B_cg for a GPU kernel attaining P_kernel: past it, moving
  the data no longer bounds the op (bigger batches stop paying off);
- the balance point: the batch size at which the link time of a layer's
  streamed weights equals the compute time they feed.

`layer_times` prices one layer of a step under a policy with the same roofline
(`RooflineCost`) the simulator uses: per resource (GPU, CPU, both link
directions) the busy time, overlapped as CGOPipe overlaps them.
"""

from __future__ import annotations

import math
from typing import Literal

from attrs import frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.expert_formats import packed_expert_bytes
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec

Place = Literal["gpu", "cpu"]


@frozen
class Roof:
    name: str
    peak: float  # flop/s
    bandwidth: float  # bytes/s

    @property
    def ridge(self) -> float:
        """Intensity where the memory roof meets the compute roof."""
        return self.peak / self.bandwidth

    def attainable(self, intensity: float) -> float:
        return min(self.peak, self.bandwidth * intensity)


@frozen
class OpPoint:
    """An op of one layer (all micro-batches): where it runs, its flops, the bytes it reads from
    the memory of that level and the bytes it pulls over the CPU->GPU link."""

    name: str
    place: Place
    flops: float
    mem_bytes: float
    link_bytes: float = 0.0
    launches: float = 1  # kernels (nodes) it takes: one per micro-batch, or per expert hit
    rows: float = 0  # rows of each GEMM kernel (tokens per micro-batch, or per expert hit); 0: not a GEMM

    @property
    def intensity(self) -> float:
        return self.flops / self.mem_bytes if self.mem_bytes else math.inf

    @property
    def link_intensity(self) -> float:
        return self.flops / self.link_bytes if self.link_bytes else math.inf


@frozen
class Hierarchy:
    gpu: Roof
    cpu: Roof
    link: float  # CPU -> GPU bytes/s

    @classmethod
    def from_hardware(cls, hw: HardwareSpec) -> Hierarchy:
        """The sustained roofs the simulator prices with: a large GEMM's share of the tensor peak and
        the streaming share of memory bandwidth, summed over tensor-parallel GPUs (each with its own
        pinned link); the CPU's sustained flop/s and GEMM bandwidth."""
        g = hw.gpus
        gpu = Roof(
            "gpu", g * hw.gpu_flops * hw.gemm_share(math.inf), g * hw.gpu_bandwidth * hw.gpu_memory_efficiency
        )
        cpu = Roof("cpu", hw.cpu_flops * hw.cpu_compute_efficiency, hw.cpu_bandwidth * hw.cpu_gemm_efficiency)
        return cls(gpu, cpu, g * hw.h2d_bandwidth)

    @property
    def p1(self) -> float:
        return self.cpu.peak / self.link

    def p2(self, kernel_flops: float) -> float:
        return kernel_flops / self.link

    def attainable(self, op: OpPoint) -> float:
        """P_x^i of the HRM (flop/s)."""
        roof = self.gpu if op.place == "gpu" else self.cpu
        perf = roof.attainable(op.intensity)
        if op.place == "gpu" and op.link_bytes:
            perf = min(perf, self.link * op.link_intensity)
        return perf

    def better_on_cpu(self, op: OpPoint) -> bool:
        """Whether an op on CPU-homed data attains more computed on the CPU than moved to the GPU."""
        on_cpu = OpPoint(op.name, "cpu", op.flops, op.link_bytes or op.mem_bytes)
        on_gpu = OpPoint(op.name, "gpu", op.flops, op.mem_bytes, op.link_bytes or op.mem_bytes)
        return self.attainable(on_cpu) > self.attainable(on_gpu)


@frozen
class Phase:
    """A step's shape for the model: N sequences in micro-batches of μ, `new` tokens each,
    attending `context` keys on average (after this step)."""

    sequences: int
    micro_batch: int
    new: int
    context: int

    @property
    def micro_batches(self) -> int:
        return -(-self.sequences // self.micro_batch)

    @property
    def mb_tokens(self) -> int:
        return self.micro_batch * self.new

    @property
    def mb_attended(self) -> int:
        """(query, key) pairs one micro-batch's attention computes."""
        past = self.context - self.new
        return self.micro_batch * (self.new * past + self.new * (self.new + 1) // 2)


@frozen
class LayerTimes:
    gpu: float
    cpu: float
    h2d: float
    d2h: float

    @property
    def total(self) -> float:
        """Resources overlap (CGOPipe): the layer takes as long as its busiest resource."""
        return max(self.gpu, self.cpu, self.h2d, self.d2h)

    @property
    def bound(self) -> str:
        named = {"GPU compute": self.gpu, "CPU compute": self.cpu, "CPU->GPU link": self.h2d,
                 "GPU->CPU link": self.d2h}  # fmt: skip
        return max(named, key=named.__getitem__)

    def __add__(self, other: LayerTimes) -> LayerTimes:
        return LayerTimes(
            self.gpu + other.gpu, self.cpu + other.cpu, self.h2d + other.h2d, self.d2h + other.d2h
        )


def experts_hit(spec: ModelSpec, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to, with uniform top-k routing."""
    e, k = spec.moe.experts, spec.moe.top_k
    return e * (1 - (1 - k / e) ** tokens)


def layer_ops(spec: ModelSpec, phase: Phase, policy: Policy, moe: bool = True) -> list[OpPoint]:
    """The ops of one layer for all micro-batches of a step, placed by the policy."""
    a, b, h = spec.attention, spec.dtype_bytes, spec.hidden
    q, kv, out = a.q_width, a.kv_width, a.out_width
    n, t = phase.micro_batches, phase.mb_tokens
    kv_bytes = phase.micro_batch * phase.context * 2 * kv * b
    link = n * kv_bytes * (1 - policy.kv_gpu_share) if policy.attention_on == "gpu" else 0.0
    reads: float = n * (kv_bytes + t * (q + out) * b)
    attn = OpPoint("attention", policy.attention_on, n * phase.mb_attended * a.pair_flops(), reads, link, n)
    ops = [
        _matmul("pre-attention", a.pre_params(h), n, t, b, t * (h + q + 2 * kv) * b),
        attn,
        _matmul("post-attention", out * h, n, t, b, t * (out + 2 * h) * b),
    ]
    if not moe:
        return [*ops, _matmul("dense ffn", 3 * h * spec.moe.dense_intermediate, n, t, b, 2 * t * h * b)]
    ops.append(_matmul("router", spec.moe.experts * h, n, t, b, t * h * b))
    if spec.moe.has_shared:
        ops.append(_matmul("shared ffn", 3 * h * spec.moe.shared_intermediate, n, t, b, 2 * t * h * b))
    expert_bytes = 3 * h * spec.moe.intermediate * b
    hit = experts_hit(spec, t)
    flops = n * 6 * t * spec.moe.top_k * h * spec.moe.intermediate
    form = policy.expert_format
    crossing = expert_bytes if form == "native" else packed_expert_bytes(spec, form)  # on the link
    streamed = (1 - policy.weights_gpu_share) * spec.moe.experts * crossing
    reads = n * (hit * expert_bytes + 2 * t * spec.moe.top_k * h * b)
    link = streamed if policy.ffn_on == "gpu" else 0.0
    ops.append(OpPoint("moe ffn", policy.ffn_on, flops, reads, link, n * hit, t * spec.moe.top_k / hit))
    return ops


def _matmul(name: str, params: int, n: int, tokens: int, b: int, activations: int) -> OpPoint:
    return OpPoint(
        name, "gpu", n * 2 * params * tokens, n * (params * b + activations), launches=n, rows=tokens
    )


_OPS = {
    "attention": Op.GPU_ATTN,
    "moe ffn": Op.EXPERT_FFN,
    "pre-attention": Op.PRE_ATTN,
    "post-attention": Op.POST_ATTN,
    "router": Op.GATE,
    "shared ffn": Op.SHARED_FFN,
    "dense ffn": Op.SHARED_FFN,
}


def layer_times(
    spec: ModelSpec, hw: HardwareSpec, phase: Phase, policy: Policy, moe: bool = True
) -> LayerTimes:
    """Busy time of each resource for one layer of a step under `policy`, priced as the simulator
    prices its nodes (sustained figures, GEMM efficiency at each kernel's rows, tensor-parallel
    splits and the two all-reduces per layer and micro-batch)."""
    cost = RooflineCost(hw, spec)
    a, b, h = spec.attention, spec.dtype_bytes, spec.hidden
    q, kv, out = a.q_width, a.kv_width, a.out_width
    n, t = phase.micro_batches, phase.mb_tokens
    gpu, cpu, h2d, d2h = 2 * n * cost.all_reduce_seconds(t), 0.0, 0.0, 0.0
    for op in layer_ops(spec, phase, policy, moe):
        seconds = cost.compute_seconds(op.place, op.flops, op.mem_bytes, op.name == "attention", op.rows)
        lane = Lane.GPU_COMPUTE if op.place == "gpu" else Lane.CPU_COMPUTE
        seconds += op.launches * cost.fixed(lane, _OPS.get(op.name, Op.PRE_ATTN))
        gpu, cpu = (gpu + seconds, cpu) if op.place == "gpu" else (gpu, cpu + seconds)
        h2d += cost.transfer_seconds(Lane.GPU_H2D, op.link_bytes)
    if policy.attention_on == "cpu":  # q, k, v down and the attention output up, per micro-batch
        d2h += cost.transfer_seconds(Lane.GPU_D2H, n * t * (q + 2 * kv) * b)
        h2d += cost.transfer_seconds(Lane.GPU_H2D, n * t * out * b)
    elif policy.kv_gpu_share < 1:  # this step's new k, v back to the CPU-homed cache
        d2h += cost.transfer_seconds(Lane.GPU_D2H, n * t * 2 * kv * b * (1 - policy.kv_gpu_share))
    if moe and policy.ffn_on == "cpu":  # hidden states down, expert outputs up
        d2h += cost.transfer_seconds(Lane.GPU_D2H, n * t * h * b)
        h2d += cost.transfer_seconds(Lane.GPU_H2D, n * t * spec.moe.top_k * h * b)
    return LayerTimes(gpu, cpu, h2d, d2h)


@frozen
class StepTimes:
    """A whole step: layers one after another, each overlapping its own resources."""

    seconds: float
    busy: LayerTimes  # summed over layers

    @property
    def bound(self) -> str:
        return self.busy.bound


def step_times(spec: ModelSpec, hw: HardwareSpec, phase: Phase, policy: Policy) -> StepTimes:
    moe = sum(1 for layer in range(spec.layers) if spec.is_moe_layer(layer))
    per_moe = layer_times(spec, hw, phase, policy, True)
    seconds, busy = moe * per_moe.total, _times(per_moe, moe)
    if moe < spec.layers:
        per_dense = layer_times(spec, hw, phase, policy, False)
        seconds += (spec.layers - moe) * per_dense.total
        busy = busy + _times(per_dense, spec.layers - moe)
    return StepTimes(seconds, busy)


def _times(times: LayerTimes, count: int) -> LayerTimes:
    return LayerTimes(times.gpu * count, times.cpu * count, times.h2d * count, times.d2h * count)


def balance_point(
    spec: ModelSpec, hw: HardwareSpec, policy: Policy, context: int, limit: int = 1 << 16
) -> int:
    """The smallest batch size N (decode, micro-batches of the policy's μ) at which a layer is no
    longer bound by the CPU->GPU link, or `limit` if it stays link bound."""

    def link_bound(sequences: int) -> bool:
        times = layer_times(spec, hw, Phase(sequences, policy.micro_batch_size, 1, context), policy)
        return times.bound == "CPU->GPU link"

    lo, hi = policy.micro_batch_size, policy.micro_batch_size
    while link_bound(hi):
        if hi >= limit:
            return limit
        lo, hi = hi, min(limit, hi * 2)
    while hi - lo > policy.micro_batch_size:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if link_bound(mid) else (lo, mid)
    return hi
