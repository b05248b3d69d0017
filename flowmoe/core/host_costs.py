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
    (the hook's wrapper around a module call); `per_pageable_byte`: seconds per byte of a pageable
    PAGE_COPY on top of the roofline's pageable copy."""

    name: str
    per_transfer: float = 0.0
    per_call: float = 0.0
    per_pageable_byte: float = 0.0
    source: str = ""

    def __call__(self, node: TaskNode) -> float:
        if node.op is Op.PAGE_COPY:
            return self.per_transfer + (self.per_pageable_byte * node.bytes if node.pageable else 0.0)
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
#
# The bytes (bench/gpu-runs/2026-11-28-h200, one session on one NVIDIA H200 PCIe host, 16-core Xeon,
# accelerate 1.15.0, torch 2.11.0+cu130): hooks.json, bench/accelerate_hooks.py --device cuda: one hooked
# module of a Mixtral expert's three bf16 14336x4096 tensors (352,321,536 B, data in DRAM: randn) copied
# in and freed again per call in 47.36 ms (plain `.to(cuda)` of the same tensors 44.69 ms: 7.9 GB/s,
# host-timed); the hook's fixed part on the same GPU is 54.0 us per tensor + 32.9 us per call (4x4
# tensors). gpu.jsonl ("peaks"): that host's pageable H2D peak is 19.4 GB/s (bench/gpu_support.py
# link_peaks: `copy_` of one 512 MiB buffer into a preallocated one, CUDA-event-timed, best of 5; its
# source is `torch.empty`, never written). What the hooked module pays beyond its fixed part and the
# bytes at that peak: (47.36 ms - 3 x 54.0 us - 32.9 us - 352.3 MB / 19.4 GB/s) / 352.3 MB = 82.4 ps
# per byte. Not measured: tensors of other sizes (transformers 5's fused 0.94 and 1.88 GB ones).
H200_EXPERT_BYTES = 3 * 14336 * 4096 * 2
H200_EXPERT_HOOKED_S = 0.047361093099999606
H200_HOOK_PER_TENSOR_S, H200_HOOK_PER_CALL_S = 5.396777035711255e-05, 3.2895400178734974e-05
H200_PAGEABLE_PEAK = 19415108166.98643  # bytes/s
ACCELERATE_PER_PAGEABLE_BYTE = (
    H200_EXPERT_HOOKED_S - 3 * H200_HOOK_PER_TENSOR_S - H200_HOOK_PER_CALL_S
    - H200_EXPERT_BYTES / H200_PAGEABLE_PEAK
) / H200_EXPERT_BYTES  # fmt: skip
ACCELERATE = HostCosts(
    "accelerate",
    per_transfer=80e-6,
    per_call=32e-6,
    per_pageable_byte=ACCELERATE_PER_PAGEABLE_BYTE,
    source=(
        "bench/accelerate_hooks.py, AMD EPYC 2-vCPU VM (2026-11-27, accelerate 1.15.0): AlignDevicesHook "
        "with offload=True, 112/176/256/511 us per call of a module with 1/2/3/6 tensors = 80 us per "
        "tensor + 32 us per call (Python only; the copy itself is priced by the roofline); per byte: "
        "bench/gpu-runs/2026-11-28-h200 (hooks.json, gpu.jsonl's peaks), a hooked Mixtral expert module "
        "(352.3 MB) in 47.36 ms on an H200 host less its 3 x 54.0 + 32.9 us hook and the bytes at the "
        "host's measured 19.4 GB/s pageable peak = 82.4 ps per byte"
    ),
)
FAMILIES = {family.name: family for family in (IDEAL, ACCELERATE)}


def family(name: str) -> HostCosts:
    """The host costs of system family `name`; ConfigError naming the known ones."""
    found = FAMILIES.get(name)
    if found is None:
        raise ConfigError(f"unknown host-cost family {name!r}; known: {', '.join(FAMILIES)}")
    return found
