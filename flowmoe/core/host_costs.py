"""Fixed host costs a system family pays per weight transfer and per hooked module call (issue 28).

The roofline (`cost.RooflineCost`) prices what the hardware does; a framework that moves weights
from Python hooks also pays, per tensor it moves and per module call it wraps, a fixed time on the
host that no copy or kernel shows: the hook's Python, the tensor's re-binding to the module, the
allocator call, the freeing after. flowmoe's own plans issue a copy per page from its lane threads
(their per-node costs: `HardwareSpec.copy_latency`, `host_dispatch`), so the family `ideal` adds
nothing; a scheduler that stands in for a hook-based offloader names its family (`host_family`, a
class attribute) and the simulator prices its nodes with that family's costs on top.

A family's figures are host (Python) time measured on a machine and carried to every preset as is:
a faster desktop CPU runs them faster, so they are what that framework pays on the measuring
host, stated with it in `source`.
"""

from __future__ import annotations

from attrs import frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import Lane, Op, TaskNode


@frozen
class HostCosts:
    """`per_transfer`: seconds per PAGE_COPY node (a hook moves one tensor per node: its pre-forward
    binds it on the GPU, its post-forward unbinds it); `per_call`: seconds per GPU EXPERT_FFN node
    (the hook's wrapper around a module call)."""

    name: str
    per_transfer: float = 0.0
    per_call: float = 0.0
    source: str = ""

    def __call__(self, node: TaskNode) -> float:
        if node.op is Op.PAGE_COPY:
            return self.per_transfer
        if node.op is Op.EXPERT_FFN and node.lane is Lane.GPU_COMPUTE:
            return self.per_call
        return 0.0


IDEAL = HostCosts(
    "ideal", source="flowmoe's own lane threads: no cost beyond the roofline's per-node figures"
)
# bench/accelerate_hooks.py on the dev VM (AMD EPYC, 2 vCPUs, load ~1.5, 2026-11-27; accelerate 1.15.0,
# torch 2.13 CPU): a module with n tensors under `attach_align_device_hook(offload=True)`, called with its
# execution device = where its weights are (so no byte moves: only the hook's Python runs), takes
# 112 / 176 / 256 / 511 us for n = 1 / 2 / 3 / 6 against 1.2 us bare; least squares: 80 us per tensor
# (pre_forward's set_module_tensor_to_device from the weights map, post_forward's back to "meta"), 32 us
# per call (the wrapper, send_to_device of inputs and outputs).
ACCELERATE = HostCosts(
    "accelerate",
    per_transfer=80e-6,
    per_call=32e-6,
    source=(
        "bench/accelerate_hooks.py, AMD EPYC 2-vCPU VM (2026-11-27, accelerate 1.15.0): AlignDevicesHook "
        "with offload=True, 112/176/256/511 us per call of a module with 1/2/3/6 tensors = 80 us per "
        "tensor + 32 us per call (Python only; the copy itself is priced by the roofline)"
    ),
)
FAMILIES = {family.name: family for family in (IDEAL, ACCELERATE)}


def family(name: str) -> HostCosts:
    """The host costs of system family `name`; ConfigError naming the known ones."""
    found = FAMILIES.get(name)
    if found is None:
        raise ConfigError(f"unknown host-cost family {name!r}; known: {', '.join(FAMILIES)}")
    return found
