"""Which worker serves which lane on this machine, with how many threads (the thread plan)."""

from __future__ import annotations

import os

import torch

from flowmoe.core.executor import Worker
from flowmoe.core.plan import Lane
from flowmoe.core.threads import ThreadPlan, free_cores, plan_threads, usable_cores
from flowmoe.devices.cuda import CudaStreamWorker, EventBook
from flowmoe.devices.inline import InlineWorker
from flowmoe.devices.threadpool import ThreadPoolWorker

LAUNCH_CORES = 1  # with CUDA: the core the event loop and the stream launch threads keep


def host_plan(gpu: torch.device, threads: int | None = None) -> ThreadPlan:
    """The thread plan of a run on `gpu` with --cpu-threads `threads` (flowmoe/core/threads.py):
    one thread computes on the host (without CUDA the loop's, with it the cpu.compute lane's),
    with the whole budget, less the launch core when a GPU computes. Without --cpu-threads the
    budget is OMP_NUM_THREADS where it is set, else the cores free when the run starts
    (flowmoe/core/threads.py: a team as wide as every core waits on a busy machine's co-tenants at
    each parallel region), at most the calling thread's torch threads (torch.set_num_threads)."""
    reserve = LAUNCH_CORES if gpu.type == "cuda" else 0
    default = torch.get_num_threads()
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        default = min(default, free_cores())
    return plan_threads(usable_cores(), threads, compute_threads=1, reserve=reserve, default=default)


def make_workers(
    gpu: torch.device, threads: int | None = None
) -> tuple[dict[Lane, Worker], EventBook | None]:
    """Without CUDA every lane on the event loop's thread (the "GPU" is the same cores: nothing to
    overlap); with CUDA, CUDA streams for the gpu.* lanes and host threads for cpu.compute and
    disk.read. `threads`: --cpu-threads, split by `host_plan`."""
    plan = host_plan(gpu, threads)
    if gpu.type != "cuda":
        inline = InlineWorker(plan.intra_op)
        return dict.fromkeys(Lane, inline), None
    if gpu.index is None:  # "cuda": the current device, named (streams and events need its index)
        gpu = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    events = EventBook(gpu)
    host = ThreadPoolWorker(plan.intra_op, before=events.wait_host)
    streams = CudaStreamWorker(gpu, events)
    return {lane: (streams if lane.on_gpu else host) for lane in Lane}, events
