"""A step's routing: each gate's decision and each pre-gate's prediction, per (layer, micro-batch).

On CUDA nothing here waits for the device on a lane's behalf: a gate leaves its routing on the GPU
and sends the host only its tokens per expert, one asynchronous copy into page-locked memory and an
event (`PendingRouting`); whoever needs the routing on the host first (the driver answering the
scheduler, usually) waits for that event alone.
"""

from __future__ import annotations

import threading

import torch
from attrs import define, field, frozen

from flowmoe.core.plan import ExpertCounts, RoutingRequest
from flowmoe.devices.cuda import EventBook
from flowmoe.kernels.router import Routing, choose, sort_by_expert, split_by_expert
from flowmoe.model.moe_model import MoEModel, expert_ranks
from flowmoe.model.weights import LayerWeights
from flowmoe.runtime.activations import Key
from flowmoe.runtime.device_weights import Devices


@frozen
class PendingRouting:
    """A gate's decision still on the GPU; `counts` [E] (page-locked) arrives when `ready` has."""

    indices: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    rows: torch.Tensor  # [T * k] token rows sorted by expert
    scales: torch.Tensor  # [T * k]
    counts: torch.Tensor  # [E] int64 on the host
    ready: torch.cuda.Event

    def resolve(self, events: EventBook) -> Routing:
        self.ready.synchronize()  # this gate's work only, not the whole stream
        counts = self.counts.tolist()
        events.release(self.ready)
        return split_by_expert(self.indices, self.weights, self.rows, self.scales, counts)


Table = dict[Key, Routing | PendingRouting]


@define
class Routings:
    """`events`: where a CUDA gate's events come from (None: no CUDA, the routing is on the host at once)."""

    model: MoEModel
    devices: Devices
    events: EventBook | None = None
    _decided: Table = field(factory=dict)  # the gates'
    _predicted: Table = field(factory=dict)  # the pre-gates'
    _lock: threading.Lock = field(factory=threading.Lock)
    unasked: list[Key] = field(factory=list)  # decided where no routing request asks (`decide`), in order

    def gate(
        self, key: Key, x: torch.Tensor, layer: int, lw: LayerWeights, speculative: bool = False
    ) -> None:
        """Route x [T, hidden] with layer `layer`'s router (`lw`) as (layer, mb) `key`'s decision, or
        its prediction (`speculative`, a pre-gate): on the host at once without CUDA; on CUDA left on
        the GPU, its counts on their way to the host."""
        table = self._predicted if speculative else self._decided
        if self.events is None:
            table[key] = self.model.gate(layer, x, lw)
            return
        assert lw.router is not None, f"layer {layer} is dense: it has no router"
        indices, weights = choose(x, lw.router, lw.router_bias, self.model.spec.moe, lw.selection_bias)
        rows, scales, counts = sort_by_expert(indices, weights, self.model.spec.moe.experts)
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=self.devices.cuda)
        host.copy_(counts, non_blocking=True)
        ready = self.events.take()
        ready.record()
        table[key] = PendingRouting(indices, weights, rows, scales, host, ready)

    def decide(self, key: Key, routing: Routing) -> None:
        """(layer, mb) `key`'s routing as a node that gates on its own decided it (a whole layer's, the
        `cpu` schedule's): no routing request asks for it, so the runtime records it from `unasked`."""
        self._decided[key] = routing
        self.unasked.append(key)

    def gated(self, key: Key) -> bool:
        """Whether (layer, mb) was gated (a dense layer's combine has no routing)."""
        return key in self._decided

    def decided(self, key: Key) -> Routing:
        """The gate's routing of (layer, mb) on the host, waiting for its counts the first time."""
        return self._resolved(self._decided, key)

    def counts(self, request: RoutingRequest) -> ExpertCounts:
        """The driver's answer: tokens per expert of the gate (or pre-gate) the request names, and
        where it asks for Expert Deferral each expert's best rank among its tokens' top-k."""
        table = self._predicted if request.speculative else self._decided
        routing = self._resolved(table, (request.layer, request.mb))
        ranks = tuple(expert_ranks(routing).items()) if request.defer else ()
        return ExpertCounts(request.layer, request.mb, tuple(routing.counts().items()), ranks=ranks)

    def _resolved(self, table: Table, key: Key) -> Routing:
        routing = table[key]
        if isinstance(routing, PendingRouting):
            with self._lock:  # the driver and a lane thread may ask at once: one resolves it
                routing = table[key]
                if isinstance(routing, PendingRouting):
                    assert self.events is not None, "a routing is left pending only on CUDA, with events"
                    routing = table[key] = routing.resolve(self.events)
        return routing
