"""A step's inputs where each lane computes: every micro-batch's StepInput, and its token layout and
rope on the lane's device, uploaded once per lane and micro-batch (not once per layer), so the
lane's own stream orders the upload before every use."""

from __future__ import annotations

import torch
from attrs import define, field

from flowmoe.core.plan import Lane
from flowmoe.jobs.engine import StepInput
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.rope import Rotary
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.device_weights import Devices


@define
class LaneInputs:
    """Each micro-batch's token ids, KV cache and layout (`steps`), where its cache layers live
    (`kv_gpu`: the layers homed on the GPU, the rest on the CPU), and what a lane derives from them."""

    model: MoEModel
    devices: Devices
    steps: dict[int, StepInput]
    kv_gpu: frozenset[int] = frozenset()
    _layouts: dict[tuple[int, Lane], TokenLayout] = field(factory=dict)
    _ropes: dict[tuple[int, Lane], Rotary] = field(factory=dict)

    def __getitem__(self, mb: int) -> StepInput:
        return self.steps[mb]

    def place(self, lane: Lane) -> torch.device:
        """Where `lane` computes: the host for cpu.compute, the GPU device for the others."""
        return self.devices.cpu if lane is Lane.CPU_COMPUTE else self.devices.gpu

    def layout(self, mb: int, lane: Lane) -> TokenLayout:
        """The micro-batch's token layout with its indices where `lane` computes."""
        key = (mb, lane)
        layout = self._layouts.get(key)
        if layout is None:
            layout, place = self.steps[mb].layout, self.place(lane)
            if layout.positions.device != place:
                layout = layout.to(place)
            self._layouts[key] = layout
        return layout

    def rope(self, mb: int, lane: Lane) -> Rotary:
        """The micro-batch's rotary embedding where `lane` computes."""
        key = (mb, lane)
        rope = self._ropes.get(key)
        if rope is None:
            rope = self._ropes[key] = self.model.rope(self.layout(mb, lane), self.place(lane))
        return rope
