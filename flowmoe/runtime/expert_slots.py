"""The device's copies of routed experts in one buffer of equal slots (issue 29 item 3), so that a
group of experts present on the device is one strided view [S, out, in] per projection
(kernels/grouped_experts.py) with no copy, as a layer's experts are in its host arena.

A slot holds one expert's bytes as its host span lays them (runtime/paged_copy.py lands the pages
there), resident and staged experts alike. The slots are made once, at setup, as many as the
accounting already charges: the resident experts and the scheduler's copy buffer in whole experts
(DeviceWeights.setup takes a pool only where that buffer holds experts alone, every dense part
resident, so the pool's bytes are what the ledger holds and no more).

A slot's reuse is guarded as the caching allocator guards a freed expert's memory today: the EVICT
that frees it records an event on its lane's stream (where the allocator took `record_stream`), and
the copy that next lands in it orders its own stream after that event (`wait_event`: on the device,
no host wait). Without CUDA every copy is synchronous and no event is needed.
"""

from __future__ import annotations

import torch
from attrs import define, field
from torch import cuda

from flowmoe.core.errors import FlowmoeError
from flowmoe.runtime.paged_copy import Paged


@define
class ExpertSlots:
    """`pool`: uint8 [slots * slot_bytes] on the device; `cuda`: guard reuse with events."""

    pool: torch.Tensor
    slot_bytes: int
    cuda: bool
    _free: list[int] = field(factory=list)  # slots no expert holds, the lowest taken first
    # slot -> its bytes and an expert's weights as views of them: every expert lies in a slot alike, so
    # the views made at a slot's first copy serve each later one (no operation per copy but the copy)
    landed: dict[int, tuple[torch.Tensor, Paged]] = field(factory=dict)
    _events: dict[int, torch.cuda.Event] = field(factory=dict)  # slot -> its event, recorded at each eviction
    _evicted: set[int] = field(factory=set)  # free slots whose event the next copy must wait for

    @classmethod
    def make(cls, device: torch.device, slots: int, slot_bytes: int) -> ExpertSlots:
        pool = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)  # [slots * slot_bytes]
        return cls(pool, slot_bytes, device.type == "cuda", list(range(slots - 1, -1, -1)))

    @property
    def slots(self) -> int:
        return self.pool.numel() // self.slot_bytes

    def take(self) -> int:
        """A free slot, for a copy about to be enqueued on the current stream, which first waits for the
        slot's last eviction (CUDA)."""
        if not self._free:
            raise FlowmoeError(
                f"all {self.slots} expert slots on the device are held: the memory check admitted more "
                "experts than the scheduler's buffer declares"
            )
        slot = self._free.pop()
        if slot in self._evicted:  # the wait is enqueued now: the event may be recorded again later
            self._evicted.discard(slot)
            cuda.current_stream(self.pool.device).wait_event(self._events[slot])
        return slot

    def room(self, slot: int) -> torch.Tensor:
        """The slot's bytes: uint8 [slot_bytes], a view of the pool."""
        return self.pool[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def give(self, slot: int) -> None:
        """EVICT, on the lane that used the slot last: free once that lane's stream is past here."""
        if self.cuda:
            event = self._events.get(slot)
            if event is None:
                event = self._events[slot] = cuda.Event()
            event.record(cuda.current_stream(self.pool.device))
            self._evicted.add(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)
