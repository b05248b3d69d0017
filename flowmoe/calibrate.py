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
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from attrs import evolve, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.plan import Lane

Report = Callable[[str], None]
COMPUTE = (Lane.GPU_COMPUTE, Lane.CPU_COMPUTE)


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


def matmul_rates(
    device: torch.device, dtype: torch.dtype, quick: bool, sync: Callable[[], None]
) -> tuple[float, float]:
    """(flop/s at prefill size, weight bytes/s at decode size) of x @ w."""
    k = n = 2048 if quick else 4096
    w = torch.randn(k, n, device=device, dtype=dtype)
    big, small = (
        torch.randn(512, k, device=device, dtype=dtype),
        torch.randn(8, k, device=device, dtype=dtype),
    )
    repeats = 5 if quick else 20
    prefill = timed(lambda: big @ w, repeats, sync)
    decode = timed(lambda: small @ w, repeats, sync)
    return 2 * 512 * k * n / prefill, w.numel() * w.element_size() / decode


def copy_bandwidth(device: torch.device, quick: bool, sync: Callable[[], None]) -> float:
    """Stream copy: bytes read + written per second."""
    size = (64 if quick else 256) * 2**20 // 4
    a, b = torch.empty(size, device=device), torch.randn(size, device=device)
    return 2 * a.numel() * 4 / timed(lambda: a.copy_(b), 5 if quick else 10, sync)


def attention_flops(device: torch.device, dtype: torch.dtype, quick: bool, sync: Callable[[], None]) -> float:
    """flowmoe's attention kernel on decode steps: 16 sequences attending 512 keys."""
    from flowmoe.kernels.attention import attend
    from flowmoe.kernels.layout import TokenLayout

    seqs, context, heads, kv_heads, dim = 16, 256 if quick else 512, 16, 4, 128
    layout = TokenLayout(tuple(range(seqs)), (1,) * seqs, (context - 1,) * seqs)
    q = torch.randn(seqs, heads, dim, device=device, dtype=dtype)
    keys = torch.randn(seqs, kv_heads, context, dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    seconds = timed(lambda: attend(q, keys, values, layout), 5 if quick else 20, sync)
    return 4 * seqs * context * heads * dim / seconds


def link_rates(quick: bool) -> dict[str, float]:
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
    """Median span of each op of the built-in tiny model run through the runtime (eager), minus the
    roofline time of its work: the fixed cost of dispatching that op, for both compute lanes."""
    from flowmoe.builtin import ensure_builtin
    from flowmoe.core.policy import Policy
    from flowmoe.engine import Engine, Request
    from flowmoe.loading import load_model
    from flowmoe.runtime import Runtime

    model = load_model(ensure_builtin())
    runtime = Runtime.create(model, "eager", Policy(micro_batch_size=4), device)
    requests = [Request(str(i), tuple(range(3, 19 + 4 * i)), i) for i in range(4)]
    engine = Engine(model, runtime, max_new_tokens=4 if quick else 12, cache_device=runtime.cache_device)

    async def go() -> None:
        async for _ in engine.run_batch([engine.micro_batch(0, requests)]):
            pass

    try:
        asyncio.run(go())
    finally:
        runtime.close()
    cost, spent = RooflineCost(spec), defaultdict(list)
    for span in runtime.trace.spans:
        node = span.node
        work = cost(node) - cost.fixed(node.lane, node.op)
        spent[str(node.op)].append(max(0.0, span.end - span.start - work))
    lanes = [Lane.GPU_COMPUTE] if torch.cuda.is_available() and device != "cpu" else list(COMPUTE)
    found = {f"{lane}/{op}": statistics.median(v) for op, v in spent.items() for lane in lanes}
    if "gpu_attn" in spent and Lane.CPU_COMPUTE in lanes:
        found["cpu.compute/cpu_attn"] = statistics.median(spent["gpu_attn"])
    return tuple(sorted(found.items()))


def calibrate(quick: bool = False, dtype: str = "float32", report: Report = lambda _step: None,
              device: str = "auto") -> tuple[HardwareSpec, list[Measurement]]:  # fmt: skip
    """Measure this machine; `report(step)` is told what is being measured."""
    dt, cpu = DTYPES[dtype], torch.device("cpu")
    report("CPU matmul (prefill and decode sizes)")
    cpu_flops, cpu_bandwidth = matmul_rates(cpu, dt, quick, _nosync)
    report("CPU stream copy")
    stream = copy_bandwidth(cpu, quick, _nosync)
    report("CPU attention")
    cpu_attention = attention_flops(cpu, dt, quick, _nosync)
    report("dispatch of a node")
    dispatch = dispatch_overhead(quick)
    cuda = torch.cuda.is_available() and device != "cpu"
    gpu = _gpu_figures(dt, quick) if cuda else {"gpu_flops": cpu_flops, "gpu_bandwidth": cpu_bandwidth,
                                                "gpu_attention_flops": cpu_attention}  # fmt: skip
    links = link_rates(quick) if cuda else _host_copies(quick)
    where = "CUDA" if cuda else "no CUDA: gpu.* lanes on the CPU"
    spec = HardwareSpec(
        name=f"calibrated-{os.uname().nodename}", gpu_memory=_gpu_memory(cuda), cpu_flops=cpu_flops,
        cpu_bandwidth=cpu_bandwidth, cpu_memory=_memory_bytes(), cpu_attention_flops=cpu_attention,
        gpu_launch=dispatch, cpu_launch=dispatch, copy_latency=dispatch, **gpu, **links,
        source=f"flowmoe calibrate ({dtype}, {torch.get_num_threads()} torch threads, {where})",
    )  # fmt: skip
    report("op dispatch costs (tiny model through the runtime)")
    spec = evolve(spec, op_overhead=op_overheads(spec, device, quick))
    return spec, _measurements(spec, stream, cuda, links)


def _measurements(
    spec: HardwareSpec, stream: float, cuda: bool, links: dict[str, float]
) -> list[Measurement]:
    found = [
        Measurement("CPU matmul, prefill size", spec.cpu_flops / 1e9, "GFLOP/s"),
        Measurement("CPU matmul, decode size (weights read)", spec.cpu_bandwidth / 1e9, "GB/s"),
        Measurement("CPU stream copy (read + write)", stream / 1e9, "GB/s"),
        Measurement("CPU attention (decode)", (spec.cpu_attention_flops or 0) / 1e9, "GFLOP/s"),
        Measurement("node dispatch (no-op)", spec.copy_latency * 1e6, "µs"),
    ]
    if cuda:
        found += [
            Measurement("GPU matmul, prefill size", spec.gpu_flops / 1e9, "GFLOP/s"),
            Measurement("GPU matmul, decode size (weights read)", spec.gpu_bandwidth / 1e9, "GB/s"),
            Measurement("GPU attention (decode)", (spec.gpu_attention_flops or 0) / 1e9, "GFLOP/s"),
        ]
    return found + [Measurement(name.replace("_", " "), value / 1e9, "GB/s") for name, value in links.items()]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _nosync() -> None:
    pass


def _gpu_figures(dtype: torch.dtype, quick: bool) -> dict[str, float]:
    gpu, sync = torch.device("cuda"), torch.cuda.synchronize
    flops, bandwidth = matmul_rates(gpu, dtype, quick, sync)
    return {
        "gpu_flops": flops,
        "gpu_bandwidth": bandwidth,
        "gpu_attention_flops": attention_flops(gpu, dtype, quick, sync),
    }


def _gpu_memory(cuda: bool) -> int:
    return torch.cuda.get_device_properties(0).total_memory if cuda else _memory_bytes()


def _host_copies(quick: bool) -> dict[str, float]:
    """Without CUDA a "device" copy is what Devices.to_gpu does on the CPU: returns the tensor."""
    size = (64 if quick else 256) * 2**20
    x = torch.empty(size, dtype=torch.uint8)
    seconds = max(timed(lambda: x.to("cpu", non_blocking=True), 20), 1e-9)
    return {"h2d_bandwidth": size / seconds, "d2h_bandwidth": size / seconds}


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
