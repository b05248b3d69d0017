"""Accelerate's offload hook cost per call and per tensor (the source of `core.host_costs.ACCELERATE`).

A module with n tensors gets `attach_align_device_hook(offload=True)` and its weights map on the CPU.
With `--device cpu` its execution device is the CPU, where the weights map already is: each call
then runs the hook's whole Python path (pre_forward: `set_module_tensor_to_device` of every tensor
from the weights map; post_forward: back to "meta"; the wrapper's `send_to_device` of inputs and
outputs) while no byte moves. With `--device cuda` the execution device is the GPU, as in a real
offload: every call copies each tensor in from pageable memory and, where Accelerate's
`set_module_tensor_to_device` calls `torch.cuda.empty_cache()` after a move to the GPU (0.27.2 on
every move, 0.30-1.x whenever the target is not "cpu"), hands the allocator's free blocks back to
the driver, so the next move allocates anew. Small tensors (4x4) give the cost per call and per
tensor (a least-squares line over n, the hook minus the bare module); on the GPU also one module of
a Mixtral-8x7B expert's three matrices (bf16, 4096x14336), against the same bytes copied by plain
`.to(device)` calls: what the hook adds to a real expert's copy.

    pip install --target /tmp/acc accelerate==1.15.0 --no-deps
    PYTHONPATH=/tmp/acc python bench/accelerate_hooks.py [--device cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

COUNTS = (1, 2, 3, 6)
SMALL = (4, 4)
EXPERT = (3, (14336, 4096))  # Mixtral-8x7B's w1, w3 [14336, 4096] and w2 (same count) in bf16
ROUNDS = {"cpu": (7, 2000), "cuda": (3, 200)}  # rounds, calls per round
EXPERT_ROUNDS = (3, 10)


class Tensors(nn.Module):
    """A module holding `n` tensors of `shape` of its own and computing nothing."""

    def __init__(self, n: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape).to(dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def seconds_per_call(module: nn.Module, device: torch.device, hooked: bool, rounds: tuple[int, int]) -> float:
    """The best round's mean seconds per call of `module`, hooked (offloaded, executed on `device`)
    or bare (its tensors where they are)."""
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

    if hooked:
        weights = {k: v.clone() for k, v in module.state_dict().items()}  # the offload's weights map
        attach_align_device_hook(module, execution_device=device, offload=True, weights_map=weights)
    x = torch.zeros(4, device=device)
    best = best_per_call(lambda: module(x), device, rounds)
    if hooked:
        remove_hook_from_submodules(module)
    return best


def plain_copy_seconds(tensors: list[torch.Tensor], device: torch.device, rounds: tuple[int, int]) -> float:
    """The same tensors copied to `device` by plain `.to()` calls (pageable, as the hook's source
    is), each call's copies let go: the bytes' own cost, which the roofline prices."""
    return best_per_call(lambda: [t.to(device) for t in tensors], device, rounds)


def best_per_call(call: Callable[[], object], device: torch.device, rounds: tuple[int, int]) -> float:
    """The best of `rounds[0]` rounds' mean seconds per call of `call`, `rounds[1]` calls a round,
    the device synchronized around each round (its work counted in it)."""
    best = float("inf")
    for _ in range(rounds[0]):
        _sync(device)
        start = time.perf_counter()
        for _ in range(rounds[1]):
            call()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / rounds[1])
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def line(counts: tuple[int, ...], seconds: list[float]) -> tuple[float, float]:
    """Least-squares seconds per tensor and per call over the tensor counts."""
    mean_n, mean_t = sum(counts) / len(counts), sum(seconds) / len(seconds)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(counts, seconds, strict=True)) / sum(
        (n - mean_n) ** 2 for n in counts
    )
    return slope, mean_t - slope * mean_n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, help="the measurements as JSON")
    args = parser.parse_args(argv)
    try:
        import accelerate
    except ImportError:
        print("accelerate is not installed: pip install --target DIR accelerate, then PYTHONPATH=DIR")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA device")
        return 2
    device, rounds = torch.device(args.device), ROUNDS[args.device]
    hooked = []
    for n in COUNTS:
        module = Tensors(n, SMALL, torch.float32).to(device)
        bare = seconds_per_call(module, device, False, rounds)
        hooked.append(seconds_per_call(module.cpu(), device, True, rounds) - bare)
    per_tensor, per_call = line(COUNTS, hooked)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"accelerate": accelerate.__version__, "torch": torch.__version__, "device": where,
              "hook_s_per_call": dict(zip(COUNTS, hooked, strict=True)), "per_tensor_s": per_tensor,
              "per_call_s": per_call}  # fmt: skip
    table = Table(title=f"accelerate {accelerate.__version__}, torch {torch.__version__}, {where}")
    table.add_column("module", justify="right")
    table.add_column("hook us/call", justify="right")
    for n, t in zip(COUNTS, hooked, strict=True):
        table.add_row(f"{n} x 4x4 fp32", f"{t * 1e6:.1f}")
    if args.device == "cuda":
        n, shape = EXPERT
        module = Tensors(n, shape, torch.bfloat16)
        copy = plain_copy_seconds(list(module.state_dict().values()), device, EXPERT_ROUNDS)
        hook = seconds_per_call(module, device, True, EXPERT_ROUNDS)
        result |= {"expert_plain_copy_s": copy, "expert_hooked_s": hook}
        table.add_row(f"expert {n} x {shape[0]}x{shape[1]} bf16", f"{(hook - copy) * 1e6:.1f} over its copy")
        table.add_row("(its plain copy)", f"{copy * 1e6:.1f}")
    console = Console()
    console.print(table)
    console.print(f"per tensor {per_tensor * 1e6:.1f} us, per call {per_call * 1e6:.1f} us")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
