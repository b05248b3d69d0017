"""Memory accounting: what a policy needs on the GPU and on the host, checked before a run.

flowmoe does its own accounting (weights resident, weight buffers a scheduler
pages through, KV cache kept on the GPU, activations of the largest step), so a
T4-sized budget can be enforced on a much bigger GPU and a policy that cannot
fit fails before the first token with what it would need. Host memory is checked
the same way: the weights not resident on the GPU and the KV cache kept on the
CPU must fit the host's memory, unless the schedule streams weights from a disk
tier (and the hardware has one).
"""

from __future__ import annotations

import os

from attrs import evolve, frozen

from flowmoe.core.errors import MemoryBudgetError
from flowmoe.core.expert_formats import (
    dense_layer_bytes,
    dequant_working_bytes,
    fp8_expert_bytes,
    packed_expert_bytes,
)
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.policy import ExpertFormat
from flowmoe.core.scheduling import BatchShape, Residency, Scheduler, StepShape
from flowmoe.core.spec import ModelSpec


def gib(n: float) -> str:
    """Bytes for people: 1.50 GiB, 12.0 MiB, 300 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@frozen
class MemoryNeed:
    weights: int  # resident: embeddings, head, dense parts and experts the scheduler keeps
    buffers: int  # weight buffers the scheduler copies pages and experts into
    kv_cache: int  # KV cache kept on the GPU
    activations: int  # the largest step's working set

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.kv_cache + self.activations

    def describe(self) -> str:
        return (
            f"{gib(self.total)} (resident weights {gib(self.weights)}, weight buffers {gib(self.buffers)}, "
            f"KV cache {gib(self.kv_cache)}, activations {gib(self.activations)})"
        )

    def check(self, budget: int | None, who: str) -> None:
        if budget is not None and self.total > budget:
            raise MemoryBudgetError(
                f"{who} needs {self.describe()} of GPU memory, over the {gib(budget)} budget"
            )


def resident_bytes(spec: ModelSpec, residency: Residency) -> int:
    """Embedding and head (always on the GPU) plus the dense parts and experts kept resident."""
    dense = sum(spec.layer_dense_bytes(layer) for layer in residency.dense)
    return spec.embedding_bytes + dense + len(residency.experts) * spec.expert_bytes


def activation_bytes(spec: ModelSpec, tokens: int, sequences: int) -> int:
    """Working set of one micro-batch step: hidden, q/k/v, FFN intermediates, logits (fp32)."""
    a, m = spec.attention, spec.moe
    q, kv = a.q_width, a.kv_width
    inter = max(m.intermediate * m.top_k, m.shared_intermediate, m.dense_intermediate)
    per_token = 4 * spec.hidden + q * 2 + 2 * kv + 2 * inter
    return tokens * per_token * spec.dtype_bytes + sequences * spec.vocab * 4


def step_activation_bytes(spec: ModelSpec, step: StepShape) -> int:
    """`activation_bytes` of the step's micro-batch with the most tokens (one micro-batch at a time)."""
    largest = max(step.micro_batches, key=lambda mb: mb.tokens)
    return activation_bytes(spec, largest.tokens, largest.sequences)


def kv_bytes(scheduler: Scheduler, batch: BatchShape, on_gpu: bool) -> int:
    """The KV cache bytes of `batch` homed on the GPU (`on_gpu`) or the host: every sequence of the
    scheduler's GPU-homed layers (`kv_gpu_layers`), and in each other layer the whole sequences it
    keeps on the GPU (`kv_gpu_sequences`), micro-batch by micro-batch."""
    spec = scheduler.context.spec
    layers, gpu_layers = spec.layers, len(scheduler.kv_gpu_layers())
    total = 0
    for index, prompts in enumerate(batch.prompts):
        n = len(prompts)
        gpu = gpu_layers * n + (layers - gpu_layers) * scheduler.kv_gpu_sequences(n)
        parts = gpu if on_gpu else layers * n - gpu  # of its layers x sequences caches
        total += batch.slots(index) * spec.kv_bytes_per_token * parts // (layers * n)
    return total


def gpu_memory(scheduler: Scheduler, batch: BatchShape) -> MemoryNeed:
    """The GPU memory a run of `batch` needs with `scheduler`, from its answers alone, at the step
    where it peaks (the prefill or the last decode step): the weights it keeps, the buffers it
    copies weights into and its plan's own working buffers, the GPU-homed KV cache and the working
    copies of the CPU-homed layers, the step's largest micro-batch's activations. The one figure
    the runtime's check, the simulator, the planners and bench/gpu.py use."""
    if not scheduler.uses_gpu():
        return MemoryNeed(0, 0, 0, 0)
    spec = scheduler.context.spec
    weights, home = resident_bytes(spec, scheduler.residency()), kv_bytes(scheduler, batch, on_gpu=True)
    copies = len(scheduler.kv_gpu_layers()) < spec.layers  # some cache layer is homed on the host
    copied = scheduler.weight_buffer_bytes()
    # an expert copied in packed is dequantized at its first use, beside the buffers' dequantized experts
    form = scheduler.context.policy.expert_format
    dequant = dequant_working_bytes(spec, form) if copied else 0
    needs = []
    for step in batch.steps():
        kv = home + (scheduler.kv_working_bytes(batch, step) if copies else 0)
        buffers = copied + scheduler.gpu_working_bytes(step) + dequant
        needs.append(MemoryNeed(weights, buffers, kv, step_activation_bytes(spec, step)))
    return max(needs, key=lambda need: need.total)


def physical_memory() -> int:
    """This host's physical memory in bytes (what no batch can exceed, wherever its cache lives)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_batch_size(scheduler: Scheduler, batch: BatchShape, who: str) -> None:
    """Refuse, before anything is allocated, a batch whose KV cache (on the GPU and the host
    together) and largest step's activations exceed this host's physical memory: both are sized
    from the input (prompt lengths, max_position_embeddings), so a long prompt for a model claiming
    10**9 positions is one line, not an allocation of tens of GB on the CPU path."""
    spec = scheduler.context.spec
    kv = batch.total_slots * spec.kv_bytes_per_token  # wherever each part of it lives
    acts = max(step_activation_bytes(spec, step) for step in batch.steps())
    host = physical_memory()
    if kv + acts > host:
        raise MemoryBudgetError(
            f"{who} needs {gib(kv)} of KV cache and {gib(acts)} of activations, more than this host's "
            f"{gib(host)} of memory; use shorter prompts, fewer new tokens, a smaller --batch-size "
            "or --kv-budget"
        )


def host_memory(scheduler: Scheduler, batch: BatchShape) -> HostNeed:
    """The host memory a run of `batch` needs with `scheduler`: the weights the GPU does not keep (the
    experts packed where the policy's expert format packs them) and the KV cache homed on the host."""
    spec = scheduler.context.spec
    form = scheduler.context.policy.expert_format
    packed = packed_expert_bytes(spec, form) if form != "native" else None
    kv_on_host = kv_bytes(scheduler, batch, on_gpu=False)
    residency = scheduler.residency()
    need = host_need(spec, residency, kv_on_host, expert_bytes=packed)
    attention = scheduler.context.policy.attention_format  # the dense parts offloaded keep it packed
    saved = sum(spec.layer_dense_bytes(i) - dense_layer_bytes(spec, i, attention) for i in range(spec.layers)
                if i not in residency.dense)  # fmt: skip
    return evolve(need, weights=need.weights - saved)


@frozen
class HostNeed:
    weights: int  # weights homed in host memory: everything not resident on the GPU
    kv_cache: int  # KV cache kept in host memory
    buffers: int  # pinned staging buffers and host-side activations

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers

    def describe(self) -> str:
        return (
            f"{gib(self.total)} (weights {gib(self.weights)}, KV cache {gib(self.kv_cache)}, "
            f"buffers {gib(self.buffers)})"
        )

    def refusal(self, hw: HardwareSpec, who: str, disk_tier: bool = False) -> str | None:
        """Why this cannot run on `hw`'s host memory (one line), or None: it fits, or the
        schedule spills weights to the disk tier the hardware has."""
        if self.total <= hw.cpu_memory or (disk_tier and hw.disk_bandwidth > 0):
            return None
        why = f"{hw.name} has no disk tier" if disk_tier else "the schedule has no disk tier"
        return (
            f"{who} needs {self.describe()} of host memory, over the {gib(hw.cpu_memory)} of {hw.name}; {why}"
        )

    def check(self, hw: HardwareSpec, who: str, disk_tier: bool = False) -> None:
        why = self.refusal(hw, who, disk_tier)
        if why is not None:
            raise MemoryBudgetError(why)


def host_need(
    spec: ModelSpec, residency: Residency, kv_on_host: int, buffers: int = 0, expert_bytes: int | None = None
) -> HostNeed:
    """Host memory of a run: weights the GPU does not keep, the CPU-side KV cache, buffers.
    `expert_bytes`: an expert's host bytes when kept in another format than the model's (packed)."""
    weights = spec.total_bytes - resident_bytes(spec, residency)
    if expert_bytes is not None:
        homed = sum(spec.moe.experts for layer in range(spec.layers) if spec.is_moe_layer(layer))
        weights -= (homed - len(residency.experts)) * (spec.expert_bytes - expert_bytes)
    return HostNeed(weights, kv_on_host, buffers)


def fitting_expert_format(spec: ModelSpec, hw: HardwareSpec) -> ExpertFormat:
    """How experts are homed in host memory by default: as the model's dtype where its weights fit
    there, else as FP8 where they fit so (DeepSeek-V3 is 1.34 TB in bfloat16 and ships as FP8)."""
    if host_need(spec, Residency(), 0).total <= hw.cpu_memory:
        return "native"
    fp8 = host_need(spec, Residency(), 0, expert_bytes=fp8_expert_bytes(spec))
    return "fp8" if fp8.total <= hw.cpu_memory else "native"
