"""Cost of a task node in seconds on a HardwareSpec: a roofline per lane.

Compute lanes take max(flops / peak flops, bytes / memory bandwidth) plus a
fixed launch cost; copy lanes take bytes / link bandwidth plus a latency. The
simulator, Fiddler's latency model and Klotski's planner all price nodes here.
"""

from __future__ import annotations

from attrs import frozen

from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane, Op, TaskNode

BOOKKEEPING = (Op.EVICT,)


@frozen
class RooflineCost:
    hardware: HardwareSpec

    def __call__(self, node: TaskNode) -> float:
        hw = self.hardware
        if node.op in BOOKKEEPING:
            return 0.0
        if node.lane is Lane.GPU_COMPUTE:
            return hw.gpu_launch + max(node.flops / hw.gpu_flops, node.bytes / hw.gpu_bandwidth)
        if node.lane is Lane.CPU_COMPUTE:
            return hw.cpu_launch + max(node.flops / hw.cpu_flops, node.bytes / hw.cpu_bandwidth)
        if node.lane is Lane.GPU_H2D:
            return hw.copy_latency + node.bytes / hw.h2d_bandwidth
        if node.lane is Lane.GPU_D2H:
            return hw.copy_latency + node.bytes / hw.d2h_bandwidth
        return hw.copy_latency + node.bytes / hw.disk_bandwidth
