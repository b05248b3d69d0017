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
    PAGE_COPY on top of the roofline's pageable copy; `per_dense_part`: seconds per PAGE_COPY of a
    layer's dense part (a node with no expert), whose several modules' hooks run around it (None: one
    tensor's `per_transfer`)."""

    name: str
    per_transfer: float = 0.0
    per_call: float = 0.0
    per_pageable_byte: float = 0.0
    per_dense_part: float | None = None
    source: str = ""

    def __call__(self, node: TaskNode) -> float:
        if node.op is Op.PAGE_COPY:
            dense = self.per_dense_part if node.expert < 0 else None
            fixed = self.per_transfer if dense is None else dense
            return fixed + (self.per_pageable_byte * node.bytes if node.pageable else 0.0)
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

# DeepSpeed ZeRO-3 (ZeRO-Inference, DeepSpeed-MII's offload) fetches a module's own parameters in a
# pre-forward hook on every module (deepspeed/runtime/zero/parameter_offload.py,
# `_register_hooks_recursively`; partitioned_param_coordinator.py `fetch_sub_module`) and releases them in
# its post-forward hook (`release_sub_module`: `param.partition()`, the data freed). On one GPU
# `all_gather_coalesced` takes its no-gather path (0.16.2, partition_parameters.py: `num_partitions == 1` ->
# `NoGatherCoalescedHandle`: `ds_tensor.data.to(device, non_blocking=True)` per parameter, one stream
# synchronize per module), so the bytes are one host-to-device copy per parameter, pinned where
# `offload_param.pin_memory` is set (the roofline's pinned link: the stand-in copies are marked pinned). The
# trace ZeRO-3 prefetches by is invalidated whenever the called module order changes, as an MoE layer's
# routed experts do every step (DeepSpeed #4808, tjruwase 2024-01-07: "the parameter trace cache is
# invalidated when the expert changes"), so nothing is prefetched: copy, compute, free, module after module,
# as Accelerate's hooks. Pinned is an assumption: `offload_param.pin_memory` defaulted to False until
# DeepSpeed #8207 (2026-08), and DeepSpeedExamples' zero_inference/run_model.py has `--pin-memory 0` by
# default, while its own A6000 scripts run both; Fiddler §4.1 states pin_memory for DeepSpeed-MII and
# MoE-Lightning §5.1 that ZeRO-Inference pins (`reproduce.setting.pageable`).
#
# The hooks' host time, measured (bench/zero3_hooks.py, its runs in bench/zero3_hooks.json, 2026-11-28:
# DeepSpeed 0.16.2, torch 2.13 CPU, DS_ACCELERATOR=cpu, one gloo rank, on the dev VM, AMD EPYC 2 vCPUs at
# load 6-7, timed in process CPU time, best of 7 rounds of 20 steps): a parent module calls 64 children in
# an order shuffled every step (the MoE case: every step invalidates the trace), each child holding n 4x4
# parameters of its own, under ZeRO stage 3 with offload_param "cpu" and stage3_param_persistence_threshold
# 0; the child's device is where its partition is, so no byte moves and only the hooks' Python runs. Per
# child call, less the bare module's: 205.5 us with no parameter of its own (a container, an activation, a
# norm whose parameter is persistent), 542.8 us with one (a bias-free Linear); an earlier run of 5 rounds of
# 10 steps: 250.6 / 575.2 us, and 806.6 / 972.0 us with 3 / 6 parameters; the same runs with the order fixed
# (the trace complete, prefetching on): 170.0 / 332.8 us.
# A transformers 4.x expert call runs the hooks of its MLP module and its activation (no parameter of their
# own) and of its three Linears (one each): 2 x 205.5 + 3 x 542.8 = 2.039 ms, charged on its three copies
# (a third each), since the hooks run whether the call has tokens or not (an empty call has no FFN node).
# A layer's dense part (one PAGE_COPY here) is priced as a transformers 4.x GQA decoder layer (Mixtral):
# the decoder layer, attention, rotary embedding and sparse-MoE block, its two norms and its router
# (32768 elements: persistent under the default stage3_param_persistence_threshold of 1e5) without a
# parameter to fetch, q/k/v/o with one: 7 x 205.5 + 4 x 542.8 = 3.610 ms. Not priced: DeepSeek-V2's MLA and
# shared-expert layer has 9 + 8 such modules (6.192 ms, 2.58 ms more per layer); the model's own embedding,
# final norm and LM head modules (once per step); the CUDA calls of the fetch (a copy launch per
# parameter, a stream synchronize per module, the freed tensors), absent on the CPU.
ZERO3_MODULE_S = 0.00020554535078124992  # a module call without a parameter of its own
ZERO3_LINEAR_S = 0.0005428065640625022  # with one
ZERO3_EXPERT_CALL_S = 2 * ZERO3_MODULE_S + 3 * ZERO3_LINEAR_S  # MLP module + act_fn, w1 + w3 + w2
DEEPSPEED = HostCosts(
    "deepspeed",
    per_transfer=ZERO3_EXPERT_CALL_S / 3,  # a third on each of the expert's three copies
    per_dense_part=7 * ZERO3_MODULE_S + 4 * ZERO3_LINEAR_S,
    source=(
        "ZeRO-3's fetch/release hooks (DeepSpeed 0.16.2 on the dev VM, CPU, one rank, module order shuffled "
        "every step as an MoE's is): 205.5 us per module call without a parameter of its own, 542.8 us with "
        "one; an expert call (MLP, act_fn, three Linears) 2.039 ms, a 4.x GQA decoder layer's dense modules "
        "(7 without, q/k/v/o with one) 3.610 ms; bytes pinned (offload_param.pin_memory), no prefetch (the "
        "MoE order invalidates ZeRO-3's trace: DeepSpeed #4808)"
    ),
)
FAMILIES = {family.name: family for family in (IDEAL, ACCELERATE, DEEPSPEED)}


def family(name: str) -> HostCosts:
    """The host costs of system family `name`; ConfigError naming the known ones."""
    found = FAMILIES.get(name)
    if found is None:
        raise ConfigError(f"unknown host-cost family {name!r}; known: {', '.join(FAMILIES)}")
    return found
