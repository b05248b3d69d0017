"""Request batching: requests -> batches of balanced micro-batches under a KV-cache budget.

MoE-Lightning's heuristic: take the requests longest first and put each into the
lightest micro-batch (fewest prompt tokens) that can still take it; a request
that no micro-batch can take is deferred to the next batch. A micro-batch's KV
cache is one [slots, capacity] rectangle per layer, so its cost is slots ×
capacity tokens, where capacity is its longest prompt plus the new tokens; the
budget bounds that product. Prompts are packed without padding, so the planner
balances the prefill work (prompt tokens) across micro-batches. While a batch runs,
a slot freed by a finished sequence takes the longest waiting request its cache
holds (`refill_slots`), and a drained micro-batch is planned anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from attrs import field, frozen

from flowmoe.core.errors import ConfigError

if TYPE_CHECKING:  # sampling.py runs tensors; a request only carries its settings
    from flowmoe.jobs.sampling import SamplingParams

JobId = str | int  # a request id exactly as the prompt file gave it: 7 and "7" are different ids


@frozen
class Request:
    id: JobId
    input_ids: tuple[int, ...]
    index: int = 0  # position in the job: ties between equal lengths keep the job's order
    # a request's own settings (an OpenAI batch body's max_tokens, sampling, stop); None: the job's
    max_new_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop: tuple[str, ...] | None = None

    def new_tokens(self, default: int) -> int:
        """The most tokens it generates: its own max_new_tokens, else the job's `default`."""
        return default if self.max_new_tokens is None else self.max_new_tokens


@frozen
class BatchLimits:
    micro_batches: int = 1
    micro_batch_size: int = 16  # μ: most sequences in one micro-batch
    max_new_tokens: int = 32
    kv_budget: int | None = None  # KV tokens (slots × capacity) per micro-batch; None: no limit
    max_length: int | None = None  # longest sequence (prompt + new tokens) the model takes

    def __attrs_post_init__(self) -> None:
        if self.micro_batches < 1 or self.micro_batch_size < 1:
            raise ConfigError("micro-batch size and count must be at least 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ConfigError(f"--kv-budget must be positive, got {self.kv_budget}")

    def need(self, request: Request) -> int:
        """KV tokens one sequence of this request fills: its prompt and every new token."""
        return len(request.input_ids) + request.new_tokens(self.max_new_tokens)

    def slots_for(self, capacity: int) -> int:
        """How many sequences of `capacity` tokens a micro-batch may hold."""
        if self.kv_budget is None:
            return self.micro_batch_size
        return min(self.micro_batch_size, self.kv_budget // capacity)

    def problem(self, request: Request) -> str | None:
        """Why this request can never run under these limits, or None."""
        need = self.need(request)
        if not request.input_ids:
            return f"request {request.id!r}: the prompt has no tokens"
        new = request.new_tokens(self.max_new_tokens)
        prompt = f"request {request.id!r}: {len(request.input_ids)} prompt + {new} new tokens"
        if self.max_length is not None and need > self.max_length:
            return f"{prompt} exceed the model's {self.max_length} positions"
        if self.kv_budget is not None and need > self.kv_budget:
            return f"{prompt} exceed the KV budget of {self.kv_budget} tokens per micro-batch"
        return None


@frozen
class MicroBatchPlan:
    requests: tuple[Request, ...]
    capacity: int  # KV tokens per slot: the longest prompt and its new tokens

    @property
    def tokens(self) -> int:
        """Prompt tokens: the micro-batch's prefill work."""
        return sum(len(r.input_ids) for r in self.requests)

    @property
    def kv_tokens(self) -> int:
        return len(self.requests) * self.capacity


def _micro_batches(plans: Iterable[MicroBatchPlan]) -> tuple[MicroBatchPlan, ...]:
    return tuple(plans)


@frozen
class BatchPlan:
    micro_batches: tuple[MicroBatchPlan, ...] = field(converter=_micro_batches)

    @property
    def requests(self) -> int:
        return sum(len(mb.requests) for mb in self.micro_batches)


def longest_first(requests: Sequence[Request]) -> list[Request]:
    """Requests by prompt length, longest first; ties keep the job's order."""
    return sorted(requests, key=lambda r: (-len(r.input_ids), r.index))


def plan_batch(queue: Sequence[Request], limits: BatchLimits) -> tuple[BatchPlan, list[Request]]:
    """Fill one batch from `queue` (longest first into the lightest micro-batch that can take it)
    -> (the batch, the requests deferred to later batches, longest first)."""
    members: list[list[Request]] = [[] for _ in range(limits.micro_batches)]
    capacity = [0] * limits.micro_batches
    load = [0] * limits.micro_batches
    deferred: list[Request] = []
    for request in longest_first(queue):
        need = limits.need(request)
        fits = [
            i
            for i in range(limits.micro_batches)
            if len(members[i]) + 1 <= limits.slots_for(max(capacity[i], need))
        ]
        if not fits:
            deferred.append(request)
            continue
        lightest = min(fits, key=lambda i: (load[i], i))
        members[lightest].append(request)
        capacity[lightest] = max(capacity[lightest], need)
        load[lightest] += len(request.input_ids)
    plans = [MicroBatchPlan(tuple(m), c) for m, c in zip(members, capacity, strict=True) if m]
    return BatchPlan(plans), deferred


@frozen
class Opening:
    """Room a running micro-batch has for new sequences after a step."""

    free: int  # slots no sequence holds
    slots: int  # slots its cache has
    capacity: int  # KV tokens per slot
    load: int  # tokens its next step computes


def refill_slots(
    openings: Sequence[Opening], queue: list[Request], limits: BatchLimits
) -> list[list[Request]]:
    """Requests for the free slots of running micro-batches, taken out of `queue` (longest first,
    into the lightest micro-batch whose slots hold them). A micro-batch takes none once a fresh
    one would hold more sequences than it does (shorter requests left): it drains and is planned anew."""
    taken: list[list[Request]] = [[] for _ in openings]
    free = [o.free for o in openings]
    load = [o.load for o in openings]
    kept: list[Request] = []
    for position, request in enumerate(queue):
        need = limits.need(request)
        allowed = [i for i, o in enumerate(openings) if free[i] and limits.slots_for(need) <= o.slots]
        if not allowed:  # no free slot, or only where shorter requests (later ones) would not go either
            kept.extend(queue[position:])
            break
        fits = [i for i in allowed if need <= openings[i].capacity]
        if not fits:
            kept.append(request)
            continue
        lightest = min(fits, key=lambda i: (load[i], i))
        taken[lightest].append(request)
        free[lightest] -= 1
        load[lightest] += len(request.input_ids)
    queue[:] = kept
    return taken
