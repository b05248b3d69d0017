"""Cost of a task node in seconds on a HardwareSpec: a roofline per lane, at sustained figures.

GPU compute takes max(flops / (peak x GEMM efficiency at the node's rows), bytes / sustained
memory bandwidth); CPU compute takes max(flops / sustained flop/s, bytes / sustained GEMM or
attention bandwidth). Copies take bytes / the pinned or, for a node the scheduler marks
`pageable`, the pageable bandwidth; a packed expert's copy (Policy.expert_format: fp8, int8,
int4, hqq4) moves its packed bytes alone (the GPU dequantizes the expert on the compute stream, at
its first use), a packed dense part's (Policy.attention_format) adds its dequantization. Every
node adds its lane's launch cost, and a node the scheduler marks `sync` (the host waits on it) adds
the synchronisation cost. A node stands for
several kernels (`KERNELS`): the host issues each, so a GPU node takes at least its kernels x the
host's dispatch time (the GPU runs ahead of the host only while kernels outlast their issue), and a
CPU node adds its ops' dispatch. CPU streaming work is capped by what the cores it runs on stream
(`HardwareSpec.cpu_stream_bandwidth`), so a run with fewer CPU threads attends and computes slower;
a CPU GEMM of a few rows streams its weights for longer than one row does (`cpu_gemm.rows_factor`:
weight packing and an unfilled micro-kernel tile, as measured by `flowmoe calibrate` and Fiddler).
A staging copy (cpu.stage: pageable -> pinned memcpy threads beside the compute threads) moves its
bytes at what all the host's cores stream together (`cpu_memory_efficiency`, STREAM Copy); the
nodes of the two host lanes draw on one DRAM (`host_draw`, `host_memory_bandwidth`), which the
simulator shares between those that run at once (devices/sim.py).
With several GPUs run tensor parallel each GPU computes and copies its share (weights, heads and
KV split across them, each GPU over its own link) and the O projection and the MoE combine end in
a ring all-reduce of the layer's hidden states over the interconnect, as the papers run TP.

A calibrated profile refines this: its measured rooflines (flop/s reached at each intensity,
interpolated log-log, extended by the memory roof below and flat above) price matmul-like work
and attention, and per-op fixed costs (`op_overhead`, keyed `lane/op`) replace the generic
launch cost. The simulator, Fiddler's latency model, Klotski's planner and the HRM policy
search all price work here.
"""

from __future__ import annotations

import bisect
import math
from typing import Protocol, runtime_checkable

from attrs import field, frozen

from flowmoe.core.cpu_gemm import rows_factor
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.host_costs import IDEAL, HostCosts
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.spec import ModelSpec

BOOKKEEPING = (Op.EVICT,)
ATTENTION = (Op.CPU_ATTN, Op.GPU_ATTN)
HOST_LANES = (Lane.CPU_COMPUTE, Lane.CPU_STAGE)  # what runs on the host's cores, from its DRAM
ALL_REDUCED = (Op.POST_ATTN, Op.COMBINE)  # tensor parallel: row-parallel outputs summed across GPUs
# Kernels (GPU) or ops (CPU) a node stands for: one per distinct computation, as a PyTorch layer with
# fused norm, RoPE and attention kernels and HF's separate projections issues them (HF transformers'
# MixtralDecoderLayer / MixtralSparseMoeBlock). Any other node (a copy, the bookkeeping) is one.
KERNELS: dict[Op, int] = {
    Op.EMBED: 1,  # gather
    Op.PRE_ATTN: 6,  # norm, q, k, v projections, RoPE, KV-cache write
    Op.GPU_ATTN: 3,  # scores, softmax, weighted values
    Op.CPU_ATTN: 3,
    Op.POST_ATTN: 3,  # O projection, residual add, norm
    Op.GATE: 3,  # router GEMM, softmax, top-k
    Op.PREGATE: 3,
    Op.EXPERT_FFN: 6,  # token gather, w1, w3, activation, multiply, w2
    Op.SHARED_FFN: 5,  # w1, w3, activation, multiply, w2
    Op.COMBINE: 3,  # routing-weight scale, scatter-add, residual add
    Op.LM_HEAD: 2,  # norm, vocabulary GEMM
    Op.LAYER: 24,  # its parts': PRE_ATTN, attention, POST_ATTN, GATE, one expert's FFN, COMBINE
}


@frozen
class RooflineCost:
    """`spec` gives the element size (fp32 GEMMs run at the fp32 peak) and the hidden size the
    all-reduces of a multi-GPU spec move; without it, 16-bit elements and one GPU are assumed.
    `threads`: the run's CPU threads (a policy's `cpu_threads`); None: every core of the host.
    `kernel_share`: (op, share) for ops whose kernels in the simulated system reach only that share
    of the GPU's GEMM rate (none: cuBLAS-class kernels, what the preset's GEMM efficiency measures;
    a system with slower kernels on that GPU says so, with its source, where it is simulated).
    `host`: the fixed host costs of the simulated system's family per weight transfer and per hooked
    module call (`host_costs`; IDEAL: flowmoe's own, nothing beyond the per-node figures)."""

    hardware: HardwareSpec
    spec: ModelSpec | None = None
    threads: int | None = None
    kernel_share: tuple[tuple[Op, float], ...] = ()
    host: HostCosts = IDEAL
    _overhead: dict[str, float] = field(init=False, eq=False, repr=False)
    _kernels: dict[Op, float] = field(init=False, eq=False, repr=False)
    _curves: dict[str, Curve | None] = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        hw = self.hardware
        if hw.gpus > 1 and self.spec is None:
            raise ConfigError(
                f"hardware {hw.name} runs {hw.gpus} GPUs tensor parallel: its cost needs the model"
            )
        object.__setattr__(self, "_overhead", dict(hw.op_overhead))
        object.__setattr__(self, "_kernels", dict(self.kernel_share))
        curves = {"gpu": Curve.of(hw.gpu_roofline), "cpu": Curve.of(hw.cpu_roofline),
                  "gpu/attention": Curve.of(hw.gpu_attention_roofline),
                  "cpu/attention": Curve.of(hw.cpu_attention_roofline)}  # fmt: skip
        object.__setattr__(self, "_curves", curves)

    @property
    def dtype_bytes(self) -> int:
        return self.spec.dtype_bytes if self.spec is not None else 2

    def __call__(self, node: TaskNode) -> float:
        if node.op in BOOKKEEPING:
            return 0.0
        fixed = self.fixed(node.lane, node.op) + (self.hardware.sync_latency if node.sync else 0.0)
        fixed += self.host(node)
        if node.lane in (Lane.GPU_COMPUTE, Lane.CPU_COMPUTE):
            seconds = self.compute_seconds(
                node.lane.device, node.flops, node.bytes, node.op in ATTENTION, node.rows,
                self._kernels.get(node.op, 1.0),
            )  # fmt: skip
            if node.lane is Lane.GPU_COMPUTE:
                seconds = max(seconds, self.dispatch_seconds(node.op))
                if node.op in ALL_REDUCED:
                    seconds += self.all_reduce_seconds(node.rows)
            return fixed + seconds
        if node.lane is Lane.CPU_STAGE:
            return fixed + node.bytes / self.stage_bandwidth
        copy = self.transfer_seconds(node.lane, node.bytes, node.pageable)
        return fixed + copy + self.dequant_seconds(node)

    def dequant_seconds(self, node: TaskNode) -> float:
        """A copy with flops carries packed weights the GPU dequantizes: a memory-bound pass, reading
        the packed page and writing the weights' dtype, at one flop per weight (the unpacking and zero
        of int4 add a few more, far under the GPU's flop/s). A dense part's runs on the copy's own
        stream, as it arrives; an expert's on the compute stream, at its first use
        (runtime/device_weights.py: one fused kernel per int4 projection), so its copy is charged none:
        that pass's bytes and flops are the first GPU EXPERT_FFN's since the copy (NodeFactory)."""
        if node.flops == 0 or node.lane is not Lane.GPU_H2D or node.expert >= 0:
            return 0.0
        return self.compute_seconds("gpu", node.flops, node.bytes + node.flops * self.dtype_bytes)

    def fixed(self, lane: Lane, op: Op) -> float:
        """The fixed cost of one node: measured for this op, else the lane's launch cost (on the
        CPU, plus the dispatch of each of the node's ops: the CPU runs them one after another)."""
        measured = self._overhead.get(f"{lane}/{op}")
        if measured is not None:
            return measured
        hw = self.hardware
        if lane is Lane.GPU_COMPUTE:
            return hw.gpu_launch
        if lane in HOST_LANES:
            return hw.cpu_launch + KERNELS.get(op, 1) * hw.cpu_op_dispatch
        return hw.copy_latency

    @property
    def stage_bandwidth(self) -> float:
        """A host memcpy's bytes/s (read + written): MoE-Lightning's staging copy is one PyTorch
        `copy_` per page, which runs parallel over the intra-op pool (every core: the artifact sets
        no thread count), so it streams at what all the cores reach together, STREAM Copy's share
        of the DRAM peak, capped by cores x what one core streams."""
        return self.hardware.cpu_stream_bandwidth(self.hardware.cpu_memory_efficiency)

    @property
    def host_memory_bandwidth(self) -> float:
        """What the host's DRAM sustains for everything its cores stream at once: the nodes of
        the host lanes that run together share it (`host_draw`)."""
        return self.hardware.cpu_bandwidth * self.hardware.cpu_memory_efficiency

    def host_draw(self, node: TaskNode) -> float:
        """Bytes/s of host DRAM `node` streams while it runs alone (0: a node off the host's cores)."""
        if node.lane not in HOST_LANES or node.bytes <= 0:
            return 0.0
        seconds = self(node)
        return node.bytes / seconds if seconds > 0 else 0.0

    def dispatch_seconds(self, op: Op) -> float:
        """The host's time to issue a GPU node's kernels: the node takes at least this (a measured
        fixed cost for the op already holds it)."""
        if f"{Lane.GPU_COMPUTE}/{op}" in self._overhead:
            return 0.0
        return KERNELS.get(op, 1) * self.hardware.host_dispatch

    def compute_seconds(
        self,
        device: str,
        flops: float,
        n_bytes: float,
        attention: bool = False,
        rows: float = 0,
        kernel: float = 1.0,
    ) -> float:
        """Time of work on `device` ("gpu" or "cpu"), without the fixed cost. `rows`: the GEMM's
        rows (tokens per expert), 0 when not known (priced as a large GEMM on the GPU, as one row's
        streaming on the CPU); `kernel`: the share of the GPU's GEMM rate the kernel reaches. GPU
        work is split across the spec's GPUs."""
        hw = self.hardware
        if device == "gpu":
            flops, n_bytes = flops / hw.gpus, n_bytes / hw.gpus
        curve = self._curves[f"{device}/attention" if attention else device]
        if curve is not None and flops > 0 and n_bytes > 0:
            return flops / curve.attained(flops / n_bytes)
        if device == "gpu":
            share = hw.gemm_share(rows if rows > 0 and not attention else math.inf)
            peak = hw.peak_flops(self.dtype_bytes) * share * kernel
            return max(flops / peak, n_bytes / (hw.gpu_bandwidth * hw.gpu_memory_efficiency))
        efficiency = hw.cpu_attention_efficiency if attention else hw.cpu_gemm_efficiency
        bandwidth = hw.cpu_stream_bandwidth(efficiency, self.threads)
        compute = hw.cpu_flops * hw.cpu_compute_efficiency * hw.cpu_share(self.threads)
        streaming = n_bytes / bandwidth * (1.0 if attention else rows_factor(rows))
        return max(flops / compute, streaming)

    def all_reduce_seconds(self, rows: float) -> float:
        """A ring all-reduce of `rows` hidden states across the GPUs: each sends and receives
        2 (g - 1) / g of the data over the interconnect, plus a fixed latency."""
        hw = self.hardware
        if hw.gpus == 1 or self.spec is None or rows <= 0:
            return 0.0
        data = rows * self.spec.hidden * self.dtype_bytes
        return hw.interconnect_latency + 2 * (hw.gpus - 1) / hw.gpus * data / hw.interconnect_bandwidth

    def transfer_seconds(self, lane: Lane, n_bytes: float, pageable: bool = False) -> float:
        """Time of a copy on a link lane, without the fixed latency. Host links carry each
        GPU's share over its own link."""
        hw = self.hardware
        if lane is Lane.GPU_H2D:
            return n_bytes / hw.gpus / (hw.pageable_h2d if pageable else hw.h2d_bandwidth)
        if lane is Lane.GPU_D2H:
            return n_bytes / hw.gpus / (hw.pageable_d2h if pageable else hw.d2h_bandwidth)
        if hw.disk_bandwidth <= 0:
            raise ConfigError(f"hardware {hw.name} has no disk tier, but a schedule reads from disk")
        return n_bytes / hw.disk_bandwidth


@frozen
class Curve:
    """A measured roofline: flop/s reached at each intensity, interpolated in log-log space."""

    log_intensity: tuple[float, ...]
    log_flops: tuple[float, ...]

    @classmethod
    def of(cls, points: tuple[tuple[float, float], ...]) -> Curve | None:
        if not points:
            return None
        ordered = sorted(points)
        return cls(tuple(math.log(i) for i, _ in ordered), tuple(math.log(f) for _, f in ordered))

    def attained(self, intensity: float) -> float:
        x, xs, ys = math.log(intensity), self.log_intensity, self.log_flops
        if x <= xs[0]:  # below the lowest measured intensity: memory bound, flop/s falls with intensity
            return math.exp(ys[0] + x - xs[0])
        if x >= xs[-1]:
            return math.exp(ys[-1])
        k = bisect.bisect_right(xs, x)
        w = (x - xs[k - 1]) / (xs[k] - xs[k - 1])
        return math.exp(ys[k - 1] + w * (ys[k] - ys[k - 1]))


@runtime_checkable
class HostMemoryShare(Protocol):
    """A cost model whose host-lane nodes draw on one DRAM (RooflineCost): the simulator runs the
    nodes that overlap at their shares of `host_memory_bandwidth`."""

    @property
    def host_memory_bandwidth(self) -> float: ...

    def host_draw(self, node: TaskNode) -> float: ...
