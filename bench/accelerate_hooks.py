"""Accelerate's offload hook cost per call and per tensor (the source of `core.host_costs.ACCELERATE`).

A module with n tensors gets `attach_align_device_hook(offload=True)` with its execution device the
CPU, where its weights map already is: each call then runs the hook's whole Python path (pre_forward:
`set_module_tensor_to_device` of every tensor from the weights map; post_forward: back to "meta";
the wrapper's `send_to_device` of inputs and outputs) while no byte moves. The best of 7 rounds of
2,000 calls, against the bare module; a least-squares line over n gives the cost per tensor and per call.

    pip install --target /tmp/acc accelerate==1.15.0 --no-deps
    PYTHONPATH=/tmp/acc python bench/accelerate_hooks.py
"""

from __future__ import annotations

import sys
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

COUNTS = (1, 2, 3, 6)
ROUNDS, CALLS = 7, 2000


class Tensors(nn.Module):
    """A module holding `n` small tensors of its own and computing nothing."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(4, 4), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def seconds_per_call(n: int, hooked: bool) -> float:
    from accelerate.hooks import attach_align_device_hook

    module = Tensors(n)
    if hooked:
        weights = {k: v.clone() for k, v in module.state_dict().items()}
        cpu = torch.device("cpu")
        attach_align_device_hook(module, execution_device=cpu, offload=True, weights_map=weights)
    x = torch.zeros(4)
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            module(x)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best


def main() -> int:
    try:
        import accelerate
    except ImportError:
        print("accelerate is not installed: pip install --target DIR accelerate, then PYTHONPATH=DIR")
        return 2
    hooked = [seconds_per_call(n, True) - seconds_per_call(n, False) for n in COUNTS]
    mean_n, mean_t = sum(COUNTS) / len(COUNTS), sum(hooked) / len(hooked)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(COUNTS, hooked, strict=True)) / sum(
        (n - mean_n) ** 2 for n in COUNTS
    )
    table = Table(title=f"accelerate {accelerate.__version__}, torch {torch.__version__}")
    table.add_column("tensors", justify="right")
    table.add_column("hook us/call", justify="right")
    for n, t in zip(COUNTS, hooked, strict=True):
        table.add_row(str(n), f"{t * 1e6:.1f}")
    console = Console()
    console.print(table)
    console.print(f"per tensor {slope * 1e6:.1f} us, per call {(mean_t - slope * mean_n) * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
