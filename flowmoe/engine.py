"""The generation loop: micro-batches of sequences, prefill then decode steps, sampling, stop rules.

The engine does not know how a step is computed: it hands every micro-batch's
packed tokens to a StepRunner (eager, or the dataflow runtime with a scheduler)
and gets back each sequence's next-token logits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import torch
from attrs import define, field, frozen

from flowmoe.kernels.kv_cache import KVCache
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model import MoEModel
from flowmoe.sampling import SamplingParams, sample


@frozen
class Request:
    id: str
    input_ids: tuple[int, ...]
    index: int = 0  # position in the job; seeds the request's sampler


@frozen
class Result:
    id: str
    output_ids: tuple[int, ...]
    finish_reason: str  # "length" | "stop"
    prompt_tokens: int


@frozen
class StepInput:
    """One micro-batch's share of a step: its packed new tokens and where they go."""

    micro_batch: int
    ids: torch.Tensor  # [T] int64
    layout: TokenLayout
    cache: KVCache


class StepRunner(Protocol):
    async def __call__(self, model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        """-> per input, the logits of each sequence's last token [B, vocab] float32."""
        ...


async def eager_step(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
    """The reference StepRunner: each micro-batch runs layer after layer in plain PyTorch."""
    with torch.inference_mode():
        return [model.forward(i.ids, i.cache, i.layout) for i in inputs]


@define
class Slot:
    request: Request
    slot: int
    generator: torch.Generator | None
    output: list[int] = field(factory=list)
    past: int = 0

    def pending_ids(self) -> list[int]:
        """Tokens to feed next: the whole prompt first, then the last sampled token."""
        return list(self.request.input_ids) if self.past == 0 else self.output[-1:]


@define
class StepStats:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds else 0.0


@define
class MicroBatch:
    index: int
    cache: KVCache
    active: list[Slot]

    def step_input(self) -> StepInput:
        pending = [s.pending_ids() for s in self.active]
        layout = TokenLayout(
            slots=tuple(s.slot for s in self.active),
            counts=tuple(len(p) for p in pending),
            past=tuple(s.past for s in self.active),
        )
        ids = torch.tensor([t for p in pending for t in p], dtype=torch.int64)
        return StepInput(self.index, ids, layout, self.cache)


@define
class Engine:
    model: MoEModel
    runner: StepRunner | Callable[[MoEModel, Sequence[StepInput]], Awaitable[list[torch.Tensor]]]
    sampling: SamplingParams = field(factory=SamplingParams)
    max_new_tokens: int = 32
    stop_ids: frozenset[int] = frozenset()
    cache_device: torch.device = field(factory=lambda: torch.device("cpu"))
    stats: StepStats = field(factory=StepStats)

    def micro_batch(self, index: int, requests: Sequence[Request]) -> MicroBatch:
        capacity = max(len(r.input_ids) for r in requests) + self.max_new_tokens
        cache = self.model.new_cache(len(requests), capacity, self.cache_device)
        slots = [Slot(r, i, self.sampling.generator(r.index)) for i, r in enumerate(requests)]
        return MicroBatch(index, cache, slots)

    async def run_batch(self, micro_batches: list[MicroBatch]) -> AsyncIterator[Result]:
        """Run micro-batches (one batch) until every sequence has finished, yielding each as it does."""
        while any(mb.active for mb in micro_batches):
            live = [mb for mb in micro_batches if mb.active]
            inputs = [mb.step_input() for mb in live]
            prefill = any(p == 0 for i in inputs for p in i.layout.past)
            started = time.perf_counter()
            logits = await self.runner(self.model, inputs)
            elapsed = time.perf_counter() - started
            self.stats.steps += 1
            if prefill:
                self.stats.prefill_seconds += elapsed
            else:
                self.stats.decode_seconds += elapsed
            for mb, step, rows in zip(live, inputs, logits, strict=True):
                for result in self._advance(mb, step, rows):
                    yield result

    def _advance(self, mb: MicroBatch, step: StepInput, logits: torch.Tensor) -> list[Result]:
        finished, still = [], []
        for slot, count, row in zip(mb.active, step.layout.counts, logits, strict=True):
            if slot.past == 0:
                self.stats.prompt_tokens += count
            slot.past += count
            token = sample(row, self.sampling, slot.generator)
            slot.output.append(token)
            self.stats.generated_tokens += 1
            if token in self.stop_ids or len(slot.output) >= self.max_new_tokens:
                reason = "stop" if token in self.stop_ids else "length"
                finished.append(
                    Result(slot.request.id, tuple(slot.output), reason, len(slot.request.input_ids))
                )
            else:
                still.append(slot)
        mb.active = still
        return finished
