"""Cost of a task node in seconds on a HardwareSpec: a roofline per lane.

Compute lanes take max(flops / peak flops, bytes / memory bandwidth) plus a
fixed cost; copy lanes take bytes / link bandwidth plus a latency. A calibrated
profile refines this: its measured rooflines (flop/s reached at each intensity,
interpolated log-log, extended by the memory roof below and flat above) price
matmul-like work and attention, and per-op fixed costs (`op_overhead`, keyed `lane/op`) replace the generic
launch cost. The simulator, Fiddler's latency model, Klotski's
planner and the HRM policy search all price work here.
"""

from __future__ import annotations

import bisect
import math

from attrs import field, frozen

from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane, Op, TaskNode

BOOKKEEPING = (Op.EVICT,)
ATTENTION = (Op.CPU_ATTN, Op.GPU_ATTN)


@frozen
class RooflineCost:
    hardware: HardwareSpec
    _overhead: dict[str, float] = field(init=False, eq=False, repr=False)
    _curves: dict[str, Curve | None] = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        hw = self.hardware
        object.__setattr__(self, "_overhead", dict(hw.op_overhead))
        curves = {"gpu": Curve.of(hw.gpu_roofline), "cpu": Curve.of(hw.cpu_roofline),
                  "gpu/attention": Curve.of(hw.gpu_attention_roofline),
                  "cpu/attention": Curve.of(hw.cpu_attention_roofline)}  # fmt: skip
        object.__setattr__(self, "_curves", curves)

    def __call__(self, node: TaskNode) -> float:
        if node.op in BOOKKEEPING:
            return 0.0
        fixed = self.fixed(node.lane, node.op)
        if node.lane in (Lane.GPU_COMPUTE, Lane.CPU_COMPUTE):
            return fixed + self.compute_seconds(
                node.lane.device, node.flops, node.bytes, node.op in ATTENTION
            )
        return fixed + self.transfer_seconds(node.lane, node.bytes)

    def fixed(self, lane: Lane, op: Op) -> float:
        """The fixed cost of one node: measured for this op, else the lane's launch cost."""
        measured = self._overhead.get(f"{lane}/{op}")
        if measured is not None:
            return measured
        hw = self.hardware
        if lane is Lane.GPU_COMPUTE:
            return hw.gpu_launch
        if lane is Lane.CPU_COMPUTE:
            return hw.cpu_launch
        return hw.copy_latency

    def compute_seconds(self, device: str, flops: float, n_bytes: float, attention: bool = False) -> float:
        """Roofline time of work on `device` ("gpu" or "cpu"), without the fixed cost."""
        hw = self.hardware
        curve = self._curves[f"{device}/attention" if attention else device]
        if curve is not None and flops > 0 and n_bytes > 0:
            return flops / curve.attained(flops / n_bytes)
        if device == "gpu":
            return max(flops / hw.gpu_flops, n_bytes / hw.gpu_bandwidth)
        return max(flops / hw.cpu_flops, n_bytes / hw.cpu_bandwidth)

    def transfer_seconds(self, lane: Lane, n_bytes: float) -> float:
        """Time of a copy on a link lane, without the fixed latency."""
        hw = self.hardware
        if lane is Lane.GPU_H2D:
            return n_bytes / hw.h2d_bandwidth
        if lane is Lane.GPU_D2H:
            return n_bytes / hw.d2h_bandwidth
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
