"""The generation loop: micro-batches of sequences, prefill then decode steps, sampling, stop rules.

The engine does not know how a step is computed: it hands every micro-batch's
packed tokens to a StepRunner (eager, or the dataflow runtime with a scheduler)
and gets back each sequence's next-token logits. A sequence that finishes (EOS,
a stop string, max tokens) frees its cache slot; `generate` hands the slot to a
waiting request, whose prefill then shares a step with the others' decodes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import torch
from attrs import Factory, define, field, frozen

from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.scheduling import BatchShape
from flowmoe.jobs.batching import (
    BatchLimits,
    JobId,
    MicroBatchPlan,
    Opening,
    Request,
    plan_batch,
    refill_slots,
)
from flowmoe.jobs.prefill_chunks import Chunk, chunked, default_chunk, final_logits
from flowmoe.jobs.sampling import SamplingParams, sample_rows
from flowmoe.kernels.kv_cache import Homes, KVCache
from flowmoe.kernels.layout import TokenLayout
from flowmoe.model.moe_model import MoEModel, all_finite
from flowmoe.model.tokenizer import StopStrings, TextCodec

__all__ = [
    "Engine",
    "JobRunner",
    "MicroBatch",
    "Request",
    "Result",
    "Slot",
    "StepInput",
    "StepRunner",
    "eager_step",
]


@frozen
class Result:
    id: JobId
    output_ids: tuple[int, ...]
    finish_reason: str  # "length" | "stop"
    prompt_tokens: int
    text: str | None = None  # the output text when a stop string cut it (before the stop string)


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


class JobRunner(StepRunner, Protocol):
    """What a job runs its steps on (the runtime): a StepRunner that says where the engine allocates
    the KV cache and checks, before the first step, that the run's largest batch fits its budget."""

    @property
    def cache_device(self) -> Homes: ...

    def check_memory(self, batch: BatchShape) -> object: ...


async def eager_step(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
    """The reference StepRunner: each micro-batch runs layer after layer in plain PyTorch."""
    with torch.inference_mode():
        return [model.forward(i.ids, i.cache, i.layout) for i in inputs]


def _copies_to_gpu(runner: object) -> bool:
    """Whether `runner` (a runtime: runtime/runner.py) runs on a GPU that holds copies of weights."""
    devices = getattr(runner, "devices", None)
    return bool(getattr(devices, "copies", False))


def _chunk_input(step: StepInput, chunk: Chunk) -> StepInput:
    """The share of `step` that `chunk` covers."""
    ids = step.ids[chunk.start : chunk.start + chunk.layout.tokens]  # [chunk's tokens]
    return StepInput(step.micro_batch, ids, chunk.layout, step.cache)


@define
class Slot:
    request: Request
    slot: int
    sampling: SamplingParams  # the request's own, else the job's
    generator: torch.Generator | None
    max_new_tokens: int
    stop_strings: StopStrings | None
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
    free: list[int] = field(factory=list)  # cache slots no sequence holds

    @property
    def slots(self) -> int:
        return len(self.active) + len(self.free)

    def opening(self) -> Opening:
        load = sum(len(s.pending_ids()) for s in self.active)
        return Opening(len(self.free), self.slots, self.cache.capacity, load)

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
    cache_device: Homes = field(factory=lambda: torch.device("cpu"))  # every layer's cache, or each one's
    stats: StepStats = field(factory=StepStats)
    stop_strings: StopStrings | None = None
    on_step: Callable[[int], None] = lambda tokens: None  # tokens generated by each step
    codec: TextCodec | None = None  # decodes the outputs of requests with stop strings of their own
    # a micro-batch's tokens per runner call, at most (None: no limit; default: prefill_chunks.py's)
    prefill_chunk: int | None = field(
        default=Factory(
            lambda e: default_chunk(e.cache_device, _copies_to_gpu(e.runner), e.model.dtype), takes_self=True
        )
    )

    def open(self, index: int, plan: MicroBatchPlan) -> MicroBatch:
        """A micro-batch with a cache of one slot per planned request, `plan.capacity` tokens each."""
        cache = self.model.new_cache(len(plan.requests), plan.capacity, self.cache_device)
        return MicroBatch(index, cache, [self._slot(r, i) for i, r in enumerate(plan.requests)])

    def micro_batch(self, index: int, requests: Sequence[Request]) -> MicroBatch:
        capacity = max(len(r.input_ids) + r.new_tokens(self.max_new_tokens) for r in requests)
        return self.open(index, MicroBatchPlan(tuple(requests), capacity))

    async def generate(self, requests: Sequence[Request], limits: BatchLimits) -> AsyncIterator[Result]:
        """Every request through balanced micro-batches, each freed slot refilled from the queue;
        results are yielded as sequences finish."""
        unfit = next(filter(None, map(limits.problem, requests)), None)
        if unfit is not None:
            raise ConfigError(unfit)
        batch, queue = plan_batch(requests, limits)
        micro_batches = [self.open(i, p) for i, p in enumerate(batch.micro_batches)]
        async for result in self.run_batch(micro_batches, lambda mbs: self._refill(mbs, queue, limits)):
            yield result

    async def run_batch(
        self,
        micro_batches: list[MicroBatch],
        refill: Callable[[list[MicroBatch]], None] | None = None,
    ) -> AsyncIterator[Result]:
        """Run micro-batches until every sequence has finished, yielding each as it does;
        `refill` may admit new sequences (in place) between steps."""
        while any(mb.active for mb in micro_batches):
            live = [mb for mb in micro_batches if mb.active]
            inputs = [mb.step_input() for mb in live]
            prefill = any(p == 0 for i in inputs for p in i.layout.past)
            started = time.perf_counter()
            logits = await self._run_chunked(inputs)
            elapsed = time.perf_counter() - started
            self.stats.steps += 1
            if prefill:
                self.stats.prefill_seconds += elapsed
            else:
                self.stats.decode_seconds += elapsed
            self.on_step(sum(len(mb.active) for mb in live))
            for mb, rows in zip(live, logits, strict=True):
                if not all_finite(rows):  # the only check the normal path pays
                    raise self._non_finite(mb, rows)
            finished = [r for mb, step, rows in zip(live, inputs, logits, strict=True)
                        for r in self._advance(mb, step, rows)]  # fmt: skip
            if refill is not None:
                refill(micro_batches)
            for result in finished:
                yield result

    async def _run_chunked(self, inputs: list[StepInput]) -> list[torch.Tensor]:
        """The step on the runner, each micro-batch's tokens in chunks of at most `prefill_chunk`
        (the k-th chunks of all micro-batches in the k-th call) -> each input's logits [B, vocab]."""
        chunks = [chunked(i.layout, self.prefill_chunk) for i in inputs]
        if all(len(c) == 1 for c in chunks):  # every decode step, and a prefill that fits
            return await self.runner(self.model, inputs)
        outs: list[list[torch.Tensor]] = [[] for _ in inputs]
        for k in range(max(map(len, chunks))):
            todo = [(n, i, c[k]) for n, (i, c) in enumerate(zip(inputs, chunks, strict=True)) if k < len(c)]
            logits = await self.runner(self.model, [_chunk_input(i, c) for _, i, c in todo])
            for (n, _, _), rows in zip(todo, logits, strict=True):
                outs[n].append(rows)
        return [final_logits(c, o) for c, o in zip(chunks, outs, strict=True)]

    def _non_finite(self, mb: MicroBatch, logits: torch.Tensor) -> FlowmoeError:
        """The error for logits [B, vocab] holding NaN or Inf, naming the first layer whose output
        does when the first such sequence is re-run eagerly (a diagnostic pass, off the normal path)."""
        row = int((~torch.isfinite(logits).all(dim=-1)).nonzero()[0, 0])
        slot = mb.active[row]
        ids = torch.tensor([*slot.request.input_ids, *slot.output], dtype=torch.int64)  # [fed tokens]
        where = self.model.first_non_finite(ids)
        cause = (
            f"the eager re-run first produces them in {where}; the checkpoint's weights may hold NaN or Inf"
            if where is not None
            else "the eager re-run of the same tokens is finite, so the scheduler's step produced them"
        )
        return FlowmoeError(
            f"request {slot.request.id!r}: the model produced non-finite logits (NaN or Inf) after "
            f"{len(ids)} tokens; {cause}"
        )

    def _slot(self, request: Request, slot: int) -> Slot:
        """A sequence's slot, with the request's own sampling, new tokens and stop strings or the job's."""
        sampling = request.sampling or self.sampling
        stop = self.stop_strings
        if request.stop is not None:  # its own stop strings (empty: none), cut from the decoded text
            assert self.codec is not None or not request.stop, "a request's stop strings need the codec"
            stop = StopStrings(self.codec, request.stop) if self.codec and request.stop else None
        new_tokens = request.new_tokens(self.max_new_tokens)
        return Slot(request, slot, sampling, sampling.generator(request.id), new_tokens, stop)

    def _refill(self, micro_batches: list[MicroBatch], queue: list[Request], limits: BatchLimits) -> None:
        """Drained micro-batches are planned anew from the queue; free slots of the others take
        queued requests that fit their caches."""
        drained = [i for i, mb in enumerate(micro_batches) if not mb.active]
        if drained and queue:
            batch, queue[:] = plan_batch(queue, attrs.evolve(limits, micro_batches=len(drained)))
            for position, plan in zip(drained, batch.micro_batches, strict=False):
                micro_batches[position] = self.open(micro_batches[position].index, plan)
        openings = [mb.opening() for mb in micro_batches]
        for mb, taken in zip(micro_batches, refill_slots(openings, queue, limits), strict=True):
            for request in taken:
                mb.active.append(self._slot(request, mb.free.pop(0)))

    def _advance(self, mb: MicroBatch, step: StepInput, logits: torch.Tensor) -> list[Result]:
        finished, still = [], []
        tokens = sample_rows(logits, [s.sampling for s in mb.active], [s.generator for s in mb.active])
        for slot, count, token in zip(mb.active, step.layout.counts, tokens, strict=True):
            if slot.past == 0:
                self.stats.prompt_tokens += count
            slot.past += count
            slot.output.append(token)
            self.stats.generated_tokens += 1
            result = self._finish(slot, token)
            if result is None:
                still.append(slot)
            else:
                finished.append(result)
                mb.free.append(slot.slot)
        mb.active = still
        return finished

    def _finish(self, slot: Slot, token: int) -> Result | None:
        """The slot's result if this token ends it (EOS, a stop string, or max tokens)."""
        output, prompt = tuple(slot.output), len(slot.request.input_ids)
        if token in self.stop_ids:
            return Result(slot.request.id, output, "stop", prompt)
        text = slot.stop_strings.cut(output) if slot.stop_strings is not None else None
        if text is not None:
            return Result(slot.request.id, output, "stop", prompt, text)
        if len(output) >= slot.max_new_tokens:
            return Result(slot.request.id, output, "length", prompt)
        return None
