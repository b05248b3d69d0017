"""ZeRO-3's fetch/release hook cost per module call and per parameter (the source of
`flowmoe.core.host_costs.DEEPSPEED`), DeepSpeed on one rank, on the CPU.

A container calls K child modules, each holding n parameters of its own (4x4, computing nothing). Under
ZeRO stage 3 with `offload_param` on the CPU (`stage3_param_persistence_threshold` 0, so every parameter
is partitioned; one rank, so `all_gather_coalesced` takes its no-gather path, `ds_tensor.data.to(device)`,
here the CPU, where no byte moves) each child call runs the whole pre-forward hook (`fetch_sub_module`:
the fetch bookkeeping, the handle, the wait, the trace) and post-forward hook (`release_sub_module`:
`param.partition()`, freeing `param.data`). Per child call, less the bare module's, for each n; least
squares over n gives seconds per parameter and per module call. `order`: fixed (the trace completes
after the first step, prefetching on) or shuffled every step (the order an MoE layer's routed experts
change in, which invalidates ZeRO-3's trace every step: DeepSpeed #4808).

Runs outside CI (DeepSpeed is not a dependency):
    pip install --target DIR --no-deps deepspeed==0.16.2 hjson py-cpuinfo msgpack ninja einops \
        nvidia-ml-py psutil tqdm
    PYTHONPATH=DIR python bench/zero3_hooks.py [--out bench/zero3_hooks.json]
Process CPU time, best of `--rounds` rounds: on a shared machine a co-tenant inflates it, so run it idle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

import torch
from torch import nn

K = 64  # child modules per step
COUNTS = (0, 1, 3, 6)  # parameters per child
OFFLOAD = {"device": "cpu", "pin_memory": False}
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": OFFLOAD}
CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": ZERO3}


class Child(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(4, 4), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Parent(nn.Module):
    def __init__(self, n: int, shuffled: bool) -> None:
        super().__init__()
        self.kids = nn.ModuleList(Child(n) for _ in range(K))
        self.anchor = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.shuffled = shuffled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(range(K))
        if self.shuffled:
            random.shuffle(order)
        for i in order:
            x = self.kids[i](x)
        return x + self.anchor.sum() * 0


def per_step(model: nn.Module, x: torch.Tensor, rounds: int, steps: int = 20) -> float:
    """Process CPU seconds per forward, best of `rounds` rounds of `steps` (3 warm-up steps first)."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            model(x)
        for _ in range(rounds):
            start = time.process_time()
            for _ in range(steps):
                model(x)
            best = min(best, (time.process_time() - start) / steps)
    return best


def fit(rows: list[tuple[int, float]]) -> dict[str, object]:
    """Least squares of seconds per child call on parameters per child."""
    ns, ys = [n for n, _ in rows], [y for _, y in rows]
    mean_n, mean_y = sum(ns) / len(ns), sum(ys) / len(ys)
    slope = sum((n - mean_n) * (y - mean_y) for n, y in rows) / sum((n - mean_n) ** 2 for n in ns)
    return {"per_child_call_s": dict(rows), "per_parameter_s": slope, "per_module_s": mean_y - slope * mean_n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    import deepspeed  # not a dependency: only this bench needs it

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    x = torch.randn(1, 4)
    out: dict[str, object] = {}
    for order in ("shuffled", "fixed"):
        rows = []
        for n in COUNTS:
            random.seed(0)
            bare = per_step(Parent(n, order == "shuffled"), x, args.rounds)
            engine = deepspeed.initialize(model=Parent(n, order == "shuffled"), config=CONFIG)[0]
            engine.module.eval()
            hooked = per_step(engine.module, x, args.rounds)
            rows.append((n, (hooked - bare) / K))
            print(f"{order} n={n}: {(hooked - bare) / K * 1e6:.1f} us per child call", flush=True)
        out[order] = fit(rows)
        print(order, out[order], flush=True)
    out["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "K": K}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
