"""Pieces the successor schedules share: an expert held on the GPU across steps, and an ARC cache.

`Held` is an expert a schedule copied in and keeps (a cache entry, a prefetched
expert): the node that brought it in and its last GPU use in the plan of the
current step (both reset when a step starts: each step's plan runs on its own).
`Arc` is Megiddo and Modha's Adaptive Replacement Cache (FAST '03) over the
experts of one layer, which Fate uses for its cache; it only decides which
experts stay, never copies anything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from attrs import define, field

from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import NodeFactory


@define
class Held:
    """An expert on the GPU outside the residency: its PAGE_COPY and last GPU use in this step."""

    copy: int | None = None
    last_use: int | None = None


def cache_slots(policy: Policy, slots: int | None, moe_layers: int, experts: int) -> int:
    """The GPU expert slots of a cache schedule: `slots` (`--expert-cache-slots`), else
    `--weights-gpu-share` of every MoE layer's experts; never more than there are experts."""
    total = moe_layers * experts
    return min(total, slots or round(policy.weights_gpu_share * total))


def evict_held(f: NodeFactory, layer: int, expert: int, held: Held, lane: Lane = Lane.GPU_H2D) -> TaskNode:
    """EVICT of a held expert once its copy has landed and its last use in this step has run."""
    return f.node(Op.EVICT, lane, layer, expert=expert, deps=[held.copy, held.last_use])


def forget_step(held: Iterable[Held]) -> None:
    """A new step's plan: nothing of the previous plan is a dependency any more."""
    for h in held:
        h.copy = h.last_use = None


@define
class Arc:
    """ARC of `capacity` experts: T1 (seen once recently), T2 (seen twice or more), their ghosts B1,
    B2 and the adaptive target p of T1's size. `touch` one reference; `cached` the experts kept."""

    capacity: int
    p: float = 0.0
    t1: OrderedDict[int, None] = field(factory=OrderedDict)
    t2: OrderedDict[int, None] = field(factory=OrderedDict)
    b1: OrderedDict[int, None] = field(factory=OrderedDict)
    b2: OrderedDict[int, None] = field(factory=OrderedDict)

    @property
    def cached(self) -> set[int]:
        return {*self.t1, *self.t2}

    def touch(self, x: int) -> None:
        c = self.capacity
        if c == 0:
            return
        if x in self.t1 or x in self.t2:  # a hit: most recent of T2
            self.t1.pop(x, None)
            self.t2.pop(x, None)
            self.t2[x] = None
            return
        if x in self.b1:  # a ghost hit in B1: T1 deserved more room
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(in_b2=False)
            del self.b1[x]
            self.t2[x] = None
            return
        if x in self.b2:  # a ghost hit in B2: T2 deserved more room
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(in_b2=True)
            del self.b2[x]
            self.t2[x] = None
            return
        if len(self.t1) + len(self.b1) == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(in_b2=False)
            else:
                self.t1.popitem(last=False)
        elif len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) >= c:
            if len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) == 2 * c:
                self.b2.popitem(last=False)
            self._replace(in_b2=False)
        self.t1[x] = None

    def _replace(self, in_b2: bool) -> None:
        """Move the least recent of T1 (or T2) to its ghost list, by the target p."""
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            y, _ = self.t1.popitem(last=False)
            self.b1[y] = None
        elif self.t2:
            y, _ = self.t2.popitem(last=False)
            self.b2[y] = None
