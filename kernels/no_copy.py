"""Tensor moves that dispatch nothing where nothing has to move.

A `.to(device)` of a tensor already there still dispatches a torch operation, which on a GPU host
costs a trip through Python and the dispatcher (issue 29: the host, not the link, bounded a decode
step). `on` checks first.
"""

from __future__ import annotations

import torch


def on(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """`tensor` on `device`: itself where it is there already, else a copy."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)
