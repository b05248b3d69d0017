"""Which worker serves which lane on this machine."""

from __future__ import annotations

import torch

from flowmoe.core.executor import Worker
from flowmoe.core.plan import Lane
from flowmoe.devices.cuda import CudaStreamWorker, EventBook
from flowmoe.devices.threadpool import ThreadPoolWorker


def make_workers(
    gpu: torch.device, threads: int | None = None
) -> tuple[dict[Lane, Worker], EventBook | None]:
    """CUDA streams for the gpu.* lanes when `gpu` is a CUDA device, host threads otherwise
    (the same kernels then run on the CPU); host threads for cpu.compute and disk.read."""
    if gpu.type != "cuda":
        pool = ThreadPoolWorker(threads)
        return {lane: pool for lane in Lane}, None
    events = EventBook(gpu)
    host = ThreadPoolWorker(threads, before=events.wait_host)
    streams = CudaStreamWorker(gpu, events)
    return {lane: (streams if lane.on_gpu else host) for lane in Lane}, events
