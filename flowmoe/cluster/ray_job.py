"""One resumable job over N replicas with Ray: the driver reads and checks the prompt file, holds
the output log, and feeds chunks of requests to N replica actors; each replica streams back every
result as its request finishes, and the driver appends it to the log through the same `JobLog` a
single-process job uses. The resume contract is the single-process one: the driver is the one
writer, so killing it at any moment and re-running the same command skips the done ids and runs
the rest; a replica that dies is restarted by Ray (`max_restarts`) and the requests of its chunk
that had not come back are queued again.

Scheduling is Ray's: actors placed by their resource request, streaming generator calls, actor
restarts. The driver only keeps a queue of chunks that idle replicas take from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray
import structlog
from attrs import define, field
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from flowmoe.cluster.model_spec import model_spec
from flowmoe.cluster.replica import Finished, Replica, ReplicaConfig
from flowmoe.cluster.resources import ReplicaResources
from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.os_errors import os_reason
from flowmoe.jobs.batching import Request
from flowmoe.jobs.job import build_requests
from flowmoe.jobs.joblog import JobLog
from flowmoe.model.tokenizer import TextCodec
from flowmoe.traces.trace import Trace

log = structlog.get_logger("flowmoe.cluster.ray_job")

MAX_RESTARTS = 3  # Ray restarts a dead replica this many times before the job goes on without it
CHUNKS_PER_REPLICA = 4  # the job is cut into about this many chunks per replica: few enough that a
# replica's continuous batching stays full, enough that a slow or restarted replica leaves work
# for the others at the end
REVIVE_TRIES = 40  # a restarting replica is asked every REVIVE_WAIT s whether it is back
REVIVE_WAIT = 0.5
CONNECT_TIMEOUT = 5.0  # seconds for a cluster address to accept a connection


@contextmanager
def session(address: str) -> Iterator[str]:
    """Ray connected for the block: `local` starts a cluster of this machine's CPUs (shut down
    after it), an address joins a running one; a process already connected stays so."""
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    # without the dashboard there is no metrics agent, and each Ray process would print an error
    # after a few seconds for want of one; a value the user set is kept
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                               "logging_level": logging.WARNING}  # fmt: skip
    if address == "local":
        options["num_cpus"] = os.cpu_count()
    else:
        check_reachable(address)
        options["address"] = address
    handlers = _python_handlers()
    try:
        with warnings.catch_warnings():  # Ray's note on a future default of CUDA_VISIBLE_DEVICES
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: cannot connect to a Ray cluster ({_first_line(exc)})") from exc
    finally:
        _restore(handlers)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _python_handlers() -> dict[int, Any]:
    """The Python handlers of SIGINT and SIGTERM (the command line's: a message, exit 130 / 143)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, Any]) -> None:
    """Install them again: Ray's core worker puts a handler of its own under SIGTERM, at the C
    level, that aborts the process (exit 134) before the output log is closed."""
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


def check_reachable(address: str) -> None:
    """A host:port that does not answer is refused in seconds (Ray would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():  # "auto", a ray:// client address
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise ConfigError(
            f"--ray {address}: no Ray cluster answers there ({os_reason(exc)}); start one with "
            "`ray start --head`, or use --ray local"
        ) from exc


def alive_nodes() -> list[dict[str, float]]:
    """Each live node's total resources."""
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


@define
class ClusterProgress:
    """Callbacks a front end (the CLI's progress bars) can hook; `replica` counts from 0."""

    started: Callable[[int, int], None] = lambda requests, replicas: None
    finished: Callable[[int], None] = lambda replica: None
    generated: Callable[[int, int], None] = lambda replica, tokens: None


@define
class ReplicaReport:
    index: int
    results: int = 0  # results of this replica the driver wrote
    tokens: int = 0  # tokens it generated, as reported with its results
    restarts: int = 0  # times its actor died and a chunk was queued again


@define
class ClusterReport:
    requests: int
    skipped: int
    bad_lines: tuple[str, ...]
    replicas: list[ReplicaReport]
    startup_seconds: float = 0.0  # until every replica had loaded its model
    seconds: float = 0.0  # from then until the last result
    requeued: int = 0  # requests queued again after their replica died
    # with --trace: one per replica, in replica order (a restarted replica's since its restart),
    # each on its host's monotonic clock, so they line up when the replicas share a host
    traces: list[Trace] = field(factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(r.tokens for r in self.replicas)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def actor_name(output: str, index: int) -> str:
    """A replica actor's name (Ray's dashboard and `ray.get_actor` show it)."""
    return f"flowmoe replica {index} of {output} (driver pid {os.getpid()})"


async def run_on_cluster(
    config: ReplicaConfig,
    replicas: int,
    resources: ReplicaResources,
    cluster: str,
    progress: ClusterProgress | None = None,
) -> ClusterReport:
    """The job of `config` over `replicas` actors of `resources` each; Ray must be connected
    (`session`). Everything that can be refused is refused before the output log is opened."""
    progress = progress or ClusterProgress()
    job = config.job
    resources.check_fit(replicas, alive_nodes(), cluster)
    model = model_spec(config.source, config.dtype, config.layers)
    codec = TextCodec.from_folder(config.source) if config.model_folder else None
    if job.stop and codec is None:
        raise ConfigError("--stop needs a tokenizer.json beside the model to decode the output")
    requests, errors = build_requests(job, model, codec, job.limits(model))  # type: ignore[arg-type]  # a SpecOnly: only .spec is read
    for error in errors:
        log.warning("bad prompt line skipped", error=error)
    output = JobLog.open(job.output, job.prompts)
    try:
        todo = [r for r in requests if r.id not in output.done]
        report = ClusterReport(len(todo), len(requests) - len(todo), errors,
                               [ReplicaReport(i) for i in range(replicas)])  # fmt: skip
        log.info("cluster job started", prompts=str(job.prompts), output=str(job.output),
                 cluster=cluster, replicas=replicas, requests=len(todo), skipped=report.skipped,
                 bad_lines=len(errors))  # fmt: skip
        if todo:
            await _Driver(config, output, report, progress).run(todo, _start(config, replicas, resources))
    finally:
        output.close()
    log.info("cluster job finished", requests=report.requests, generated_tokens=report.generated_tokens,
             seconds=round(report.seconds, 3), requeued=report.requeued)  # fmt: skip
    return report


def _start(config: ReplicaConfig, replicas: int, resources: ReplicaResources) -> list[ActorHandle]:
    """The replica actors, each with its explicit resource request; Ray places them."""
    actor = ray.remote(Replica)
    return [
        actor.options(
            name=actor_name(str(config.job.output), i),
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,  # the driver re-queues what a dead replica had not returned
            max_concurrency=1,  # one chunk at a time: a replica's runtime runs one engine
        ).remote(config, i)  # type: ignore[misc]  # ray types it ActorHandle | type[Replica]; it is a handle
        for i in range(replicas)
    ]


def chunks(todo: list[Request], replicas: int, batch_size: int) -> list[list[Request]]:
    """The job's requests, in file order, in about CHUNKS_PER_REPLICA chunks per replica, each of at
    least a batch (so a replica runs full batches) where every replica still gets one."""
    size = max(batch_size, -(-len(todo) // (replicas * CHUNKS_PER_REPLICA)))
    size = min(size, -(-len(todo) // replicas))
    return [todo[i : i + size] for i in range(0, len(todo), size)]


@define
class _Driver:
    config: ReplicaConfig
    output: JobLog
    report: ClusterReport
    progress: ClusterProgress
    queue: asyncio.Queue[list[Request]] = field(factory=asyncio.Queue)

    async def run(self, todo: list[Request], actors: list[ActorHandle]) -> None:
        started = time.perf_counter()
        try:
            await _ready(actors)
            self.report.startup_seconds = time.perf_counter() - started
            started = time.perf_counter()
            for chunk in chunks(todo, len(actors), self.config.job.batch_size):
                self.queue.put_nowait(chunk)
            self.progress.started(len(todo), len(actors))
            feeders = [asyncio.create_task(self._feed(i, a)) for i, a in enumerate(actors)]
            await self._until_done(feeders)
            self.report.seconds = time.perf_counter() - started
            if self.config.record:
                self.report.traces = await asyncio.gather(*(a.trace.remote() for a in actors))
        finally:
            for actor in actors:  # also on Ctrl-C or an error: no replica outlives its job
                ray.kill(actor, no_restart=True)

    async def _until_done(self, feeders: list[asyncio.Task[None]]) -> None:
        """Until every chunk is done; a replica error stops the job, and so does losing them all."""
        done = asyncio.create_task(self.queue.join())
        running = set(feeders)
        try:
            while not done.done():
                finished, running = await asyncio.wait(running | {done}, return_when=asyncio.FIRST_COMPLETED)
                running.discard(done)
                for task in finished - {done}:
                    task.result()  # an error of the job (not a dead replica) stops it here
                if not running and not done.done():
                    raise FlowmoeError(
                        f"every replica died {MAX_RESTARTS + 1} times; the {len(self.output.done)} results "
                        "written are kept, re-run the same command to resume"
                    )
        finally:
            for task in {*feeders, done}:
                task.cancel()

    async def _feed(self, index: int, actor: ActorHandle) -> None:
        """Chunks from the queue through one replica until the job ends or the replica is gone."""
        while True:
            chunk = await self.queue.get()
            try:
                alive = await self._run_chunk(index, actor, chunk)
            finally:
                self.queue.task_done()
            if not alive:
                return

    async def _run_chunk(self, index: int, actor: ActorHandle, chunk: list[Request]) -> bool:
        """Stream a chunk's results into the log; when the replica dies, queue what did not come
        back and wait for Ray to restart it (False: it will not come back)."""
        left = {r.id: r for r in chunk}
        replica = self.report.replicas[index]
        try:
            async for ref in actor.run.remote(chunk):
                finished: Finished = await ref
                self.output.append(finished.record)
                del left[finished.record["id"]]
                replica.results += 1
                replica.tokens += finished.tokens
                self.progress.generated(index, finished.tokens)
                self.progress.finished(index)
            return True
        except RayTaskError as exc:  # the replica's code raised: the job's error (e.g. NaN logits)
            if isinstance(exc.cause, FlowmoeError):
                raise exc.cause from None
            raise
        except RayActorError as exc:
            replica.restarts += 1
            self.report.requeued += len(left)
            self.queue.put_nowait(list(left.values()))
            log.warning("replica died; its unfinished requests are queued again", replica=index,
                        requeued=len(left), error=_first_line(exc))  # fmt: skip
            return await _revive(actor)


async def _ready(actors: list[ActorHandle]) -> None:
    """Wait for every replica to load its model; a replica that cannot is the job's error."""
    for index, result in enumerate(
        await asyncio.gather(*(a.ready.remote() for a in actors), return_exceptions=True)
    ):
        if isinstance(result, RayTaskError) and isinstance(result.cause, FlowmoeError):
            raise result.cause
        if isinstance(result, BaseException):
            raise FlowmoeError(f"replica {index} could not start: {_first_line(result)}") from result


async def _revive(actor: ActorHandle) -> bool:
    """Whether a replica that died is back (Ray restarts it up to MAX_RESTARTS times)."""
    for _ in range(REVIVE_TRIES):
        try:
            await actor.ready.remote()
            return True
        except ActorDiedError:
            return False
        except ActorUnavailableError:
            await asyncio.sleep(REVIVE_WAIT)
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
