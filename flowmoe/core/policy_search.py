"""`flowmoe plan`: search the policy that maximises throughput under GPU and CPU memory limits.

The knobs are MoE-Lightning's: batch size N = μ x micro-batches, micro-batch
size μ, attention on CPU or GPU, MoE FFN on CPU or GPU, the share of expert
weights resident on the GPU and the share of the KV cache kept there. Each
candidate is priced with the HRM (`hrm.step_times`): a prefill step of the
workload's average prompt and decode steps at the average context; throughput
is generated tokens / (prefill + decode time), the papers' metric. For given
placements and sizes the resident weight share is the largest that fits, since
more resident weights never cost time; memory use follows the paper's
accounting and its usable fractions (86% of GPU memory, 80% of CPU memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from attrs import evolve, frozen

from flowmoe.core.errors import ConfigError
from flowmoe.core.expert_formats import packed_expert_bytes
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.hrm import Hierarchy, Phase, StepTimes, layer_ops, step_times
from flowmoe.core.memory import activation_bytes
from flowmoe.core.policy import ExpertFormat, Place, Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import Workload

GPU_USABLE, CPU_USABLE = 0.86, 0.8
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
KV_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


@frozen
class Candidate:
    policy: Policy
    prompt: int
    gen: int
    prefill: StepTimes
    decode: StepTimes  # one decode step at the average context
    gpu_bytes: int
    cpu_bytes: int

    @property
    def seconds(self) -> float:
        return self.prefill.seconds + (self.gen - 1) * self.decode.seconds

    @property
    def throughput(self) -> float:
        """Generated tokens per second over prefill and decode."""
        return self.policy.batch_size * self.gen / self.seconds

    @property
    def bound(self) -> str:
        return self.decode.bound


@frozen
class PlanResult:
    best: Candidate
    per_placement: tuple[Candidate, ...]  # the best of each (attention, FFN) placement that fits
    searched: int
    p1: float
    p2: float  # of the MoE FFN kernel at the chosen μ
    ffn_link_intensity: float  # where the chosen policy's streamed FFN sits on the link roof


def memory_use(spec: ModelSpec, policy: Policy, prompt: int, gen: int, gpus: int = 1) -> tuple[int, int]:
    """(GPU bytes, CPU bytes) a policy holds at its peak (the prefill of the last micro-batch). With
    `gpus` run tensor parallel the weights and KV split across them, but each holds the hidden states
    and activations whole (TP replicates them; the MoE-Lightning artifact's planner counts them
    tp_size times: fastmoe/backend/optimizer.py, gpu_home_p)."""
    n, mu, b = policy.batch_size, policy.micro_batch_size, spec.dtype_bytes
    experts = sum(spec.layer_expert_bytes(layer) for layer in range(spec.layers))
    host_experts = experts // spec.expert_bytes * packed_expert_bytes(spec, policy.expert_format)  # as homed
    layer_experts = max(spec.layer_expert_bytes(layer) for layer in range(spec.layers))
    dense = sum(spec.layer_dense_bytes(layer) for layer in range(spec.layers)) + spec.embedding_bytes
    kv = n * (prompt + gen) * spec.kv_bytes_per_token
    kv_gpu = kv * policy.kv_gpu_share if policy.attention_on == "gpu" else 0.0
    streamed = 2 * (1 - policy.weights_gpu_share) * layer_experts if policy.ffn_on == "gpu" else 0.0
    kv_buffer = 2 * mu * (prompt + gen) * spec.kv_bytes_per_token // spec.layers if kv_gpu < kv else 0
    hidden = n * prompt * spec.hidden * b
    gpu = dense + policy.weights_gpu_share * experts + streamed + kv_gpu + kv_buffer
    gpu += (hidden + activation_bytes(spec, mu * prompt, mu)) * gpus
    cpu = (1 - policy.weights_gpu_share) * host_experts + streamed + (kv - kv_gpu) + hidden
    return int(gpu), int(cpu)


def evaluate(spec: ModelSpec, hw: HardwareSpec, policy: Policy, prompt: int, gen: int) -> Candidate:
    mu, n = policy.micro_batch_size, policy.batch_size
    prefill = step_times(spec, hw, Phase(n, mu, prompt, prompt), policy)
    decode = step_times(spec, hw, Phase(n, mu, 1, prompt + max(1, gen // 2)), policy)
    gpu, cpu = memory_use(spec, policy, prompt, gen, hw.gpus)
    return Candidate(policy, prompt, gen, prefill, decode, gpu, cpu)


def _fit_share(spec: ModelSpec, hw: HardwareSpec, policy: Policy, prompt: int, gen: int) -> float | None:
    """The largest resident weight share (2 decimals) the GPU takes while the rest fits the CPU."""
    g0, c0 = memory_use(spec, _with(policy, weights_gpu_share=0.0), prompt, gen, hw.gpus)
    g1, c1 = memory_use(spec, _with(policy, weights_gpu_share=1.0), prompt, gen, hw.gpus)
    gpu_budget, cpu_budget = GPU_USABLE * hw.gpu_memory, CPU_USABLE * hw.cpu_memory
    high = 1.0 if g1 <= gpu_budget else (gpu_budget - g0) / (g1 - g0) if g1 != g0 else -1.0
    low = 0.0 if c0 <= cpu_budget else (c0 - cpu_budget) / (c0 - c1) if c0 != c1 else 2.0
    share = math.floor(min(1.0, high) * 100) / 100
    return share if share >= max(0.0, low) else None


def _with(policy: Policy, **changes: Any) -> Policy:
    return evolve(policy, **changes)


def search(
    spec: ModelSpec,
    hw: HardwareSpec,
    work: Workload,
    attention: Sequence[Place] = ("gpu", "cpu"),
    ffn: Sequence[Place] = ("gpu", "cpu"),
    micro_batches: Sequence[int] = MICRO_BATCHES,
    max_batch: int = 8192,
    expert_format: ExpertFormat = "native",
) -> PlanResult:
    prompt, gen = round(work.prompt.mean), work.gen_len
    best: dict[tuple[str, str], Candidate] = {}
    searched = 0
    for attn in attention:
        for place in ffn:
            for mu in micro_batches:
                for count in (c for c in COUNTS if c * mu <= max_batch):
                    base = Policy(mu, count, attn, place, expert_format=expert_format)
                    fitted = _best_kv(spec, hw, base, prompt, gen)
                    searched += len(KV_SHARES) if attn == "gpu" else 1
                    if fitted is None:
                        break
                    key = (attn, place)
                    if key not in best or fitted.throughput > best[key].throughput:
                        best[key] = fitted
    if not best:
        raise ConfigError(
            f"no policy fits {spec.name} on {hw.name}: even one sequence of {prompt}+{gen} tokens with every "
            f"expert in CPU memory needs more than {GPU_USABLE:.0%} of the GPU or {CPU_USABLE:.0%} of the CPU"
        )
    ranked = tuple(sorted(best.values(), key=lambda c: -c.throughput))
    return _result(spec, hw, ranked, searched)


def _best_kv(spec: ModelSpec, hw: HardwareSpec, policy: Policy, prompt: int, gen: int) -> Candidate | None:
    found: Candidate | None = None
    for kv in KV_SHARES if policy.attention_on == "gpu" else (0.0,):
        trial = _with(policy, kv_gpu_share=kv)
        share = _fit_share(spec, hw, trial, prompt, gen)
        if share is None:
            continue
        candidate = evaluate(spec, hw, _with(trial, weights_gpu_share=share), prompt, gen)
        if found is None or candidate.throughput > found.throughput:
            found = candidate
    return found


def _result(spec: ModelSpec, hw: HardwareSpec, ranked: tuple[Candidate, ...], searched: int) -> PlanResult:
    top = ranked[0]
    levels = Hierarchy.from_hardware(hw)
    phase = Phase(top.policy.batch_size, top.policy.micro_batch_size, 1, top.prompt + max(1, top.gen // 2))
    ffn = next(op for op in layer_ops(spec, phase, top.policy) if op.name == "moe ffn")
    kernel = levels.gpu.attainable(ffn.intensity)
    return PlanResult(top, ranked, searched, levels.p1, levels.p2(kernel), ffn.link_intensity)
