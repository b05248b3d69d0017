"""One replica: a full flowmoe runtime (model, scheduler, engine) that turns chunks of requests
into result records. Ray runs it as an actor (`ray_job.py`); nothing here imports Ray, so the
class runs and is tested the same way in one process.

A replica writes nothing: it streams each result's record back as the request finishes, and the
driver appends it to the job's output log (the job's one writer)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from flowmoe.core.plan import TaskNode
from flowmoe.core.policy import Policy
from flowmoe.jobs.batching import Request
from flowmoe.jobs.job import JobSpec, check_memory, make_engine, record
from flowmoe.jobs.job import Progress as JobProgress
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.tokenizer import TextCodec
from flowmoe.runtime.device_weights import Devices
from flowmoe.runtime.runner import Runtime
from flowmoe.traces.trace import Trace


@frozen
class ReplicaConfig:
    """What every replica builds: the same model, scheduler, policy and job settings."""

    source: str  # a checkpoint folder (present on every host) or a preset name
    dtype: str | None
    layers: int | None
    scheduler: str
    policy: Policy
    job: JobSpec
    device: str = "cpu"  # "cuda" where the replica holds a GPU
    threads: int = 1  # torch threads: the CPUs the replica asks Ray for
    record: bool = False  # keep a trace of every node (--trace)
    cost: Callable[[TaskNode], float] | None = None  # the scheduler's latency model (--hardware)
    popularity: tuple[tuple[float, ...], ...] | None = None  # --routing-profile's expert shares

    @property
    def model_folder(self) -> bool:
        """A checkpoint folder (which may hold a tokenizer), not a preset."""
        return Path(self.source).is_dir()


@frozen
class Finished:
    """One finished request: its output line, and the tokens the replica generated since the last
    one (for the progress bar)."""

    record: dict[str, Any]
    tokens: int


class Replica:
    """A flowmoe runtime fed chunks of requests; a chunk's results stream back as they finish."""

    def __init__(self, config: ReplicaConfig, index: int) -> None:
        torch.set_num_threads(config.threads)
        self.index = index
        # its experts packed as each layer is read, as `flowmoe run --expert-format` loads them
        packing = Packing(config.policy.expert_format, device=Devices.detect(config.device).gpu)
        self.model = load_model(config.source, config.dtype, config.layers, packing=packing)
        self.codec = TextCodec.from_folder(config.source) if config.model_folder else None
        self.runtime = Runtime.create(
            self.model, config.scheduler, config.policy, config.device, config.cost,
            record=config.record, popularity=config.popularity,
        )  # fmt: skip
        self.runtime.trace.name = f"replica {index}"
        self._tokens = 0
        hooks = JobProgress(generated=self._count)
        self.engine = make_engine(config.job, self.model, self.codec, self.runtime, hooks)
        self.limits = config.job.limits(self.model)

    def _count(self, tokens: int) -> None:
        self._tokens += tokens

    def ready(self) -> int:
        """The replica's index once its model is loaded (the driver waits for every replica)."""
        return self.index

    async def run(self, requests: list[Request]) -> AsyncIterator[Finished]:
        """Generate a chunk of requests; each result is yielded as its request finishes."""
        check_memory(self.runtime, requests, self.limits)
        async for result in self.engine.generate(requests, self.limits):
            tokens, self._tokens = self._tokens, 0
            yield Finished(record(result, self.codec), tokens)

    def trace(self) -> Trace:
        return self.runtime.trace  # the replica's process ends with the job (ray.kill), threads and all
