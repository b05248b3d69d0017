"""Cost of a task node in seconds on a HardwareSpec: a roofline per lane.

Compute lanes take max(flops / peak flops, bytes / memory bandwidth) plus a
fixed cost; copy lanes take bytes / link bandwidth plus a latency. Attention
uses the attention kernel's throughput where a calibrated profile measured it,
and a profile's per-op fixed costs (`op_overhead`, keyed `lane/op`) replace
the generic launch cost. The simulator, Fiddler's latency model, Klotski's
planner and the HRM policy search all price work here.
"""

from __future__ import annotations

from attrs import field, frozen

from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane, Op, TaskNode

BOOKKEEPING = (Op.EVICT,)
ATTENTION = (Op.CPU_ATTN, Op.GPU_ATTN)


@frozen
class RooflineCost:
    hardware: HardwareSpec
    _overhead: dict[str, float] = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_overhead", dict(self.hardware.op_overhead))

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
        if device == "gpu":
            peak = (hw.gpu_attention_flops if attention else None) or hw.gpu_flops
            return max(flops / peak, n_bytes / hw.gpu_bandwidth)
        peak = (hw.cpu_attention_flops if attention else None) or hw.cpu_flops
        return max(flops / peak, n_bytes / hw.cpu_bandwidth)

    def transfer_seconds(self, lane: Lane, n_bytes: float) -> float:
        """Time of a copy on a link lane, without the fixed latency."""
        hw = self.hardware
        if lane is Lane.GPU_H2D:
            return n_bytes / hw.h2d_bandwidth
        if lane is Lane.GPU_D2H:
            return n_bytes / hw.d2h_bandwidth
        return n_bytes / hw.disk_bandwidth
