"""A step's expert outputs, each kept until the COMBINE the plan adds it into.

That is its own layer's combine, unless its node names another (`TaskNode.combined_at`):
KTransformers' Expert Deferral plans a layer's deferred experts into the next layer's combine, which
adds their sum after its own experts (MoEModel.combine's `carry`) while their layer's combine leaves
them out. The runtime learns this from the expert nodes as they are bound, before their layer's
combine is, and infers nothing from the routing.
"""

from __future__ import annotations

import threading

import torch
from attrs import define, field

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.plan import TaskNode
from flowmoe.runtime.activations import Key

Carried = tuple[Key, list[int], dict[int, torch.Tensor]]  # (layer, mb), its experts ascending, their outputs
_NONE: frozenset[int] = frozenset()


@define
class ExpertOutputs:
    _lock: threading.Lock = field(factory=threading.Lock)
    # (layer, mb) -> {expert: the layer whose combine adds it}, for the experts planned into another's
    _elsewhere: dict[Key, dict[int, int]] = field(factory=dict)
    # (layer, mb, the layer whose combine adds them) -> expert -> its scaled output [n_e, hidden]
    _outputs: dict[tuple[int, int, int], dict[int, torch.Tensor]] = field(factory=dict)

    def __len__(self) -> int:
        """How many outputs wait for their combine."""
        with self._lock:
            return sum(len(outputs) for outputs in self._outputs.values())

    def plan(self, node: TaskNode) -> None:
        """Where an EXPERT_FFN node's output is combined, as the node says (bound before its combine)."""
        if node.combine_layer != node.layer:
            with self._lock:
                self._elsewhere.setdefault((node.layer, node.mb), {})[node.expert] = node.combine_layer

    def elsewhere(self, key: Key) -> frozenset[int]:
        """The experts of (layer, mb) whose outputs another layer's combine adds."""
        with self._lock:
            planned = self._elsewhere.get(key)
            return frozenset(planned) if planned else _NONE

    def keep(self, key: Key, outputs: dict[int, torch.Tensor]) -> None:
        """Experts' outputs [n_e, hidden] (expert -> its), each for the combine planned to add it."""
        with self._lock:
            planned = self._elsewhere.get(key)
            if not planned:  # all for their own layer's combine
                self._outputs.setdefault((*key, key[0]), {}).update(outputs)
                return
            for expert, out in outputs.items():
                self._outputs.setdefault((*key, planned.get(expert, key[0])), {})[expert] = out

    def move(self, node: TaskNode, device: torch.device) -> None:
        """EXPERT_LOAD: the outputs of node's layer and micro-batch that its combine layer adds (its
        experts, else every one computed so far) to `device`."""
        with self._lock:
            outputs = self._outputs.get((node.layer, node.mb, node.combine_layer), {})
            experts = node.experts or tuple(outputs)
        for expert in experts:
            outputs[expert] = outputs[expert].to(device, non_blocking=True)

    def own(self, key: Key) -> dict[int, torch.Tensor]:
        """The outputs (layer, mb)'s combine adds of its own layer's experts, handed over."""
        with self._lock:
            return self._outputs.pop((*key, key[0]), {})

    def carried(self, key: Key) -> list[Carried]:
        """The outputs of earlier layers' experts that (layer, mb)'s combine adds, by their layer in
        order, handed over; a FlowmoeError names a planned one that never ran."""
        layer, mb = key
        found: list[Carried] = []
        with self._lock:
            if not self._elsewhere:  # none planned into another layer's combine (no Expert Deferral)
                return found
            for source in sorted(s for s in self._elsewhere if s[1] == mb):
                experts = sorted(e for e, into in self._elsewhere[source].items() if into == layer)
                outputs = self._outputs.pop((*source, layer), {}) if experts else {}
                if set(outputs) != set(experts):
                    missing = sorted(set(experts) - set(outputs))
                    raise FlowmoeError(
                        f"combine of layer {layer} mb {mb}: experts {missing} of layer {source[0]} never ran"
                    )
                if experts:
                    found.append((source, experts, outputs))
        return found
