"""The EXPERT_FFN nodes bound and not yet run, per group: a layer, micro-batch and lane, and the
combine their outputs go into. The first node of a group to run takes with it the others whose
weights are at hand (LaneWeights.taken), for one kernel call (MoEModel.routed_experts); their own
nodes then find their outputs done. Nodes planned into different combines (Expert Deferral's) never
share a call, so a layer's kept experts are not held up by its deferred ones."""

from __future__ import annotations

import threading
from collections.abc import Callable

from attrs import define, field

from flowmoe.core.plan import Lane, TaskNode
from flowmoe.model.weights import FFNWeights

Group = tuple[int, int, Lane, int]  # (layer, mb, lane, combine layer)


def _group(node: TaskNode) -> Group:
    return node.layer, node.mb, node.lane, node.combine_layer


@define
class ExpertGroups:
    _lock: threading.Lock = field(factory=threading.Lock)
    _bound: dict[Group, dict[int, TaskNode]] = field(factory=dict)  # expert -> its node, bound, not yet run

    def bind(self, node: TaskNode) -> None:
        with self._lock:
            self._bound.setdefault(_group(node), {})[node.expert] = node

    def take(self, node: TaskNode, at_hand: Callable[[TaskNode], FFNWeights | None]) -> dict[int, FFNWeights]:
        """node's expert and the others of its group whose weights are `at_hand` (given each one's
        node), expert -> weights, no longer bound; empty where an earlier node's call took node's."""
        group = _group(node)
        with self._lock:
            bound = self._bound.get(group, {})
            if node.expert not in bound:
                return {}
            ffns = {e: ffn for e, other in bound.items() if (ffn := at_hand(other)) is not None}
            self._bound[group] = {e: other for e, other in bound.items() if e not in ffns}
        return ffns
