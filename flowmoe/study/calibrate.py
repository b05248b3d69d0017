"""Measure this machine into a HardwareSpec profile (`flowmoe calibrate`).

CPU: matmul flop/s at prefill sizes (the compute roof), matmul at decode sizes
(weights streamed: the memory roof kernels reach), stream-copy bandwidth,
attention throughput of flowmoe's own kernel, and the fixed cost of each op
as the runtime dispatches it (the built-in tiny model through the dataflow
runtime, minus the roofline time of its work). With CUDA: the same for the
GPU, HBM bandwidth, pinned and pageable host<->device copies. Without CUDA the
gpu.* lanes run on the CPU, so the GPU figures are the CPU's and copies are
what the runtime really does there (nothing).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import NotRequired, TypedDict

import torch
from attrs import evolve, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Span
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.kernels.host_memory import huge_copy
from flowmoe.model.moe_model import MoEModel

Report = Callable[[str], None]
Curve = tuple[tuple[float, float], ...]


@frozen
class Measurement:
    name: str
    value: float
    unit: str


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds of `fn` over `repeats` runs after two warm-up runs."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_curve(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int], quick: bool, sync: Callable[[], None]
) -> Curve:
    """The measured roofline: (intensity, flop/s) of flowmoe's projection kernel, x[M, K] against
    w[N, K], as M grows from 1 to 512. Successive calls use different weight matrices (COLD_BYTES
    in all), so weights come from memory, not cache, as a layer's experts do."""
    from flowmoe.kernels.linear import linear

    def next_linear(x: torch.Tensor, weights: Iterator[torch.Tensor]) -> torch.Tensor:
        return linear(x, next(weights))

    k, n = shape
    size = torch.empty((), dtype=dtype).element_size()
    copies = max(1, -(-(COLD_BYTES // (4 if quick else 1)) // (k * n * size)))
    weights = [_host_like_model(torch.randn(n, k, device=device, dtype=dtype)) for _ in range(copies)]
    points = []
    for rows in ROWS:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        turn = itertools.cycle(weights)
        seconds = timed(functools.partial(next_linear, x, turn), 3 if quick else 10, sync)
        flops, n_bytes = 2 * rows * k * n, (k * n + rows * k + rows * n) * size
        points.append((flops / n_bytes, flops / seconds))
    return tuple(points)


def _host_like_model(t: torch.Tensor) -> torch.Tensor:
    """`t` where the model keeps such a tensor: on the CPU, on the huge pages of the weights' arenas
    and the KV caches (kernels/host_memory.py; up to a third faster to stream than 4 KiB pages)."""
    if t.device.type != "cpu":
        return t
    return huge_copy(t)


COLD_BYTES = 256 * 2**20
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def copy_bandwidth(device: torch.device, quick: bool, sync: Callable[[], None]) -> float:
    """Stream copy: bytes read + written per second."""
    size = (64 if quick else 256) * 2**20 // 4
    a, b = torch.empty(size, device=device), torch.randn(size, device=device)
    return 2 * a.numel() * 4 / timed(lambda: a.copy_(b), 5 if quick else 10, sync)


def attention_curve(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    quick: bool,
    sync: Callable[[], None],
) -> Curve:
    """flowmoe's attention kernel as (intensity, flop/s) points, counted as the scheduler's nodes
    count them: a decode step (16 sequences, one query each over 256 (512) keys) and prefills of
    one sequence of growing length. `shape` = (query heads, kv heads, head dim)."""
    from flowmoe.kernels.attention import attend
    from flowmoe.kernels.layout import TokenLayout

    heads, kv_heads, dim = shape
    size, repeats = torch.empty((), dtype=dtype).element_size(), 3 if quick else 10
    cases = [(16, 1, 256 if quick else 512)] + [(1, n, n) for n in ((32, 256) if quick else (32, 128, 512))]
    points = []
    for seqs, new, context in cases:
        layout = TokenLayout(tuple(range(seqs)), (new,) * seqs, (context - new,) * seqs)
        q = torch.randn(seqs * new, heads, dim, device=device, dtype=dtype)
        keys = _host_like_model(torch.randn(seqs, kv_heads, context, dim, device=device, dtype=dtype))
        values = _host_like_model(torch.randn_like(keys))
        seconds = timed(functools.partial(attend, q, keys, values, layout), repeats, sync)
        attended = seqs * (new * (context - new) + new * (new + 1) // 2)
        flops = 4 * attended * heads * dim
        n_bytes = (seqs * context * 2 * kv_heads * dim + 2 * seqs * new * heads * dim) * size
        points.append((flops / n_bytes, flops / seconds))
    return tuple(sorted(points))


class LinkRates(TypedDict):
    """HardwareSpec's link bandwidths, measured."""

    h2d_bandwidth: float
    d2h_bandwidth: float
    h2d_pageable_bandwidth: NotRequired[float]
    d2h_pageable_bandwidth: NotRequired[float]


def link_rates(quick: bool) -> LinkRates:
    """Host<->device copy bandwidth, pinned and pageable (CUDA only)."""
    gpu, size = torch.device("cuda"), (64 if quick else 256) * 2**20
    sync, repeats = torch.cuda.synchronize, 5 if quick else 10
    pinned, pageable = torch.empty(size, dtype=torch.uint8).pin_memory(), torch.empty(size, dtype=torch.uint8)
    dev = torch.empty(size, dtype=torch.uint8, device=gpu)
    return {
        "h2d_bandwidth": size / timed(lambda: dev.copy_(pinned, non_blocking=True), repeats, sync),
        "d2h_bandwidth": size / timed(lambda: pinned.copy_(dev, non_blocking=True), repeats, sync),
        "h2d_pageable_bandwidth": size / timed(lambda: dev.copy_(pageable), repeats, sync),
        "d2h_pageable_bandwidth": size / timed(lambda: pageable.copy_(dev), repeats, sync),
    }


def dispatch_overhead(quick: bool) -> float:
    """Seconds a no-op node takes through the executor and a host thread (a copy lane here)."""
    from flowmoe.core.executor import Executor
    from flowmoe.core.plan import Op, TaskNode
    from flowmoe.devices.threadpool import ThreadPoolWorker

    count = 200 if quick else 1000
    worker = ThreadPoolWorker(profile_ranges=False)
    nodes = [TaskNode(i, Op.PAGE_COPY, Lane.GPU_H2D) for i in range(count)]

    async def run() -> list[float]:
        executor = Executor({Lane.GPU_H2D: worker})
        executor.submit_all(nodes, {n.id: (lambda: None) for n in nodes})
        await executor.drain()
        return [s.end - s.start for s in executor.spans]

    try:
        return statistics.median(asyncio.run(run()))
    finally:
        worker.close()


def op_overheads(spec: HardwareSpec, device: str, quick: bool) -> tuple[tuple[str, float], ...]:
    """The built-in tiny model through the runtime under every registered scheduler: the median
    span of each `lane/op` minus the roofline time of its work is that op's fixed cost there."""
    from flowmoe.model.builtin import ensure_builtin
    from flowmoe.model.loading import load_model
    from flowmoe.schedulers.registry import available

    model, cost = load_model(ensure_builtin()), RooflineCost(spec)
    spent: dict[str, list[float]] = defaultdict(list)
    planning = RooflineCost(spec, model.spec)  # the machine measured so far plans (no default preset)
    for name in available():
        for span in _tiny_run(model, name, device, 4 if quick else 12, planning):
            node = span.node
            work = cost(node) - cost.fixed(node.lane, node.op)
            spent[f"{node.lane}/{node.op}"].append(max(0.0, span.end - span.start - work))
    return tuple(sorted((key, statistics.median(v)) for key, v in spent.items()))


def _tiny_run(
    model: MoEModel, scheduler: str, device: str, new_tokens: int, cost: RooflineCost
) -> list[Span]:
    from flowmoe.jobs.engine import Engine, Request
    from flowmoe.runtime.runner import Runtime

    policy = Policy(micro_batch_size=2, micro_batches=2, weights_gpu_share=0.0)
    runtime = Runtime.create(model, scheduler, policy, device, cost)
    requests = [Request(str(i), tuple(range(3, 19 + 4 * i)), i) for i in range(4)]
    engine = Engine(model, runtime, max_new_tokens=new_tokens, cache_device=runtime.cache_device)

    async def go() -> None:
        mbs = [engine.micro_batch(0, requests[:2]), engine.micro_batch(1, requests[2:])]
        async for _ in engine.run_batch(mbs):
            pass

    try:
        asyncio.run(go())
    finally:
        runtime.close()
    return runtime.trace.spans


@frozen
class Shapes:
    """The kernel shapes measured: a matmul (in, out) and attention (heads, kv heads, head dim).
    Defaults are a 4096-wide projection and Mixtral's attention; `Shapes.of(spec)` takes a
    model's (its expert's gate-up projection)."""

    matmul: tuple[int, int] = (4096, 4096)
    attention: tuple[int, int, int] = (32, 8, 128)

    @classmethod
    def of(cls, spec: ModelSpec) -> Shapes:
        a = spec.attention
        return cls((spec.hidden, 2 * spec.moe.intermediate), (a.heads, a.kv_heads, a.head_dim))


def calibrate(
    quick: bool = False,
    dtype: str = "float32",
    report: Report = lambda _step: None,
    device: str = "auto",
    shapes: Shapes | None = None,
) -> tuple[HardwareSpec, list[Measurement]]:
    """Measure this machine; `report(step)` is told what is being measured."""
    dt, shapes = DTYPES[dtype], shapes or Shapes()
    matmul = (min(shapes.matmul[0], 2048), min(shapes.matmul[1], 4096)) if quick else shapes.matmul
    report("CPU matmul roofline (1 to 512 rows) and attention")
    cpu_curve, cpu_attention = _device(torch.device("cpu"), dt, matmul, shapes, quick)
    report("CPU stream copy, dispatch of a node")
    stream, dispatch = copy_bandwidth(torch.device("cpu"), quick, _nosync), dispatch_overhead(quick)
    cuda = torch.cuda.is_available() and device != "cpu"
    report("GPU matmul roofline, attention and host links" if cuda else "host copies")
    gpu_curve, gpu_attention = (
        _device(torch.device("cuda"), dt, matmul, shapes, quick) if cuda else (cpu_curve, cpu_attention)
    )
    links = link_rates(quick) if cuda else _host_copies(quick)
    where = "CUDA" if cuda else "no CUDA: gpu.* lanes on the CPU"
    cpu_read = _memory_roof(cpu_curve)
    spec = HardwareSpec(
        f"calibrated-{os.uname().nodename}", _peak(gpu_curve), _memory_roof(gpu_curve), _gpu_memory(cuda),
        _peak(cpu_curve), cpu_read, _memory_bytes(), gpu_attention_roofline=gpu_attention,
        cpu_attention_roofline=cpu_attention, gpu_roofline=gpu_curve, cpu_roofline=cpu_curve,
        gpu_launch=dispatch, cpu_launch=dispatch, copy_latency=dispatch, **links,
        cpu_memory_efficiency=stream / cpu_read,  # all cores' copy, of the matmul's read
        source=f"flowmoe calibrate ({dtype}, matmul {matmul}, {torch.get_num_threads()} threads, {where})",
    )  # fmt: skip
    report("op dispatch costs (tiny model through the runtime)")
    spec = evolve(spec, op_overhead=op_overheads(spec, device, quick))
    return spec, _measurements(spec, stream, cuda, links)


def _device(
    where: torch.device, dtype: torch.dtype, matmul: tuple[int, int], shapes: Shapes, quick: bool
) -> tuple[Curve, Curve]:
    sync = torch.cuda.synchronize if where.type == "cuda" else _nosync
    return matmul_curve(where, dtype, matmul, quick, sync), attention_curve(
        where, dtype, shapes.attention, quick, sync
    )


def _peak(curve: Curve) -> float:
    return max(f for _i, f in curve)


def _memory_roof(curve: Curve) -> float:
    """Bytes/s of the one-row matmul: weights streamed at the lowest intensity."""
    intensity, flops = min(curve)
    return flops / intensity


def _measurements(spec: HardwareSpec, stream: float, cuda: bool, links: LinkRates) -> list[Measurement]:
    found = [
        *(
            Measurement(f"CPU matmul, {rows} rows", f / 1e9, "GFLOP/s")
            for rows, (_i, f) in zip(ROWS, spec.cpu_roofline, strict=True)
        ),
        Measurement("CPU matmul, 1 row (weights read)", spec.cpu_bandwidth / 1e9, "GB/s"),
        Measurement("CPU stream copy (read + write)", stream / 1e9, "GB/s"),
        *(
            Measurement(f"CPU attention at {i:.2g} flop/B", f / 1e9, "GFLOP/s")
            for i, f in spec.cpu_attention_roofline
        ),
        Measurement("node dispatch (no-op)", spec.copy_latency * 1e6, "µs"),
    ]
    if cuda:
        found += [
            *(
                Measurement(f"GPU matmul, {rows} rows", f / 1e9, "GFLOP/s")
                for rows, (_i, f) in zip(ROWS, spec.gpu_roofline, strict=True)
            ),
            Measurement("GPU matmul, 1 row (weights read)", spec.gpu_bandwidth / 1e9, "GB/s"),
            *(
                Measurement(f"GPU attention at {i:.2g} flop/B", f / 1e9, "GFLOP/s")
                for i, f in spec.gpu_attention_roofline
            ),
        ]
    link = "{}" if cuda else "{} (no GPU: gpu.* lanes on the CPU, the copy a no-op)"
    return found + [  # the spec's figure of each link measured
        Measurement(link.format(name.replace("_", " ")), getattr(spec, name) / 1e9, "GB/s") for name in links
    ]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _nosync() -> None:
    pass


def _gpu_memory(cuda: bool) -> int:
    return torch.cuda.get_device_properties(0).total_memory if cuda else _memory_bytes()


def _host_copies(quick: bool) -> LinkRates:
    """Without CUDA a "device" copy is what Devices.to_gpu does on the CPU: returns the tensor."""
    size = (64 if quick else 256) * 2**20
    x = torch.empty(size, dtype=torch.uint8)
    seconds = max(timed(lambda: x.to("cpu", non_blocking=True), 20), 1e-9)
    return {"h2d_bandwidth": size / seconds, "d2h_bandwidth": size / seconds}


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
