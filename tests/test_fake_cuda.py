"""The CUDA stream worker's ordering logic, checked without a GPU: a stand-in for torch.cuda's
streams and events records every record / wait_event / synchronize call, and for any DAG
  * every dependency on a GPU node of another lane is waited on (stream.wait_event on its end event)
    before the node's begin event is recorded,
  * a dependency on the same lane is not (the stream orders it),
  * a host consumer (cpu.compute) synchronizes on its GPU producers' end events before it runs,
  * each GPU node's action runs with its lane's stream current,
and a step's events go back to a pool: a second step creates no new event. Also without a GPU:
a gate's routing reaches the host through its own event only, and pinned weights are one arena
per layer."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import types
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowmoe.devices.cuda as cuda_worker
from flowmoe.core.errors import ConfigError
from flowmoe.core.executor import Executor, Span
from flowmoe.core.plan import Lane, RoutingRequest, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import NodeFactory, Residency, SchedulerContext
from flowmoe.devices.factory import make_workers
from flowmoe.model.arena import ALIGN
from flowmoe.model.loading import load_model
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.pinned import pin_layers
from flowmoe.runtime.routings import Routings
from flowmoe.runtime.runner import Runtime, cap_allocator
from flowmoe.schedulers.registry import create
from flowmoe.traces.trace import Trace
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import generate, gpu_schedulers, run_eager
from tests.test_executor import check_order, dags


class FakeCuda:
    """Streams, events and the calls made on them, in the order they were made (any thread)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events_made = 0
        self._ids = itertools.count()
        self._local = threading.local()
        self.default = self.Stream()
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                fake.events_made += 1
                self.at: float | None = None
                self.blocking = blocking

            def record(self, stream=None) -> None:
                fake.log.append(("record", self, stream or fake.current_stream()))
                self.at = time.perf_counter()

            def synchronize(self) -> None:
                fake.log.append(("sync", self, threading.current_thread().name))

            def elapsed_time(self, other: Event) -> float:
                return (other.at - self.at) * 1e3  # type: ignore[operator]

        self.Event = Event
        self.nvtx = types.SimpleNamespace(range_push=lambda label: None, range_pop=lambda: None)

    def Stream(self, device=None) -> types.SimpleNamespace:
        stream = types.SimpleNamespace(id=next(self._ids))
        stream.wait_event = lambda event: self.log.append(("wait", stream, event))
        return stream

    def current_stream(self, device=None):
        return getattr(self._local, "stream", self.default)

    def set_stream(self, stream) -> None:
        self._local.stream = stream

    def set_device(self, device) -> None:
        pass

    def synchronize(self, device=None) -> None:
        self.log.append(("device sync", None, threading.current_thread().name))


def run_step(nodes: list[TaskNode], workers, fake: FakeCuda) -> list[Span]:
    def action(node: TaskNode):
        return lambda: fake.log.append(("run", node.id, fake.current_stream()))

    async def go() -> list[Span]:
        executor = Executor(workers)
        for node in nodes:
            executor.submit(node, action(node))
        await executor.drain()
        return executor.spans

    return asyncio.run(go())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_cross_lane_dependencies_are_waited_on_and_same_lane_ones_are_not(nodes: list[TaskNode]) -> None:
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_worker, "cuda", fake)
        workers, book = make_workers(torch.device("cuda"))
        try:
            spans = run_step(nodes, workers, fake)
            check(nodes, fake, book)
            made = fake.events_made
            slack = book.anchor_slack  # how late the anchor that dates this step's GPU spans may be
            retimed = book.end_step(spans)
            check_order(nodes, retimed, slack)  # GPU spans on their events' clock, the rest on the host's
            launched = {s.node.id: s.launch for s in retimed}  # the host's time in each GPU node's launch
            assert all((launched[n.id] is not None and launched[n.id] >= 0) == n.lane.on_gpu for n in nodes)
            assert not book._events and len(book._free) == 2 * sum(n.lane.on_gpu for n in nodes)
            fake.log.clear()
            run_step(nodes, workers, fake)  # the next step draws its events from the pool
            assert fake.events_made == made
            check(nodes, fake, book)
        finally:
            for worker in {id(w): w for w in workers.values()}.values():
                worker.close()


def check(nodes: list[TaskNode], fake: FakeCuda, book: cuda_worker.EventBook) -> None:
    by_id = {n.id: n for n in nodes}
    at = {}  # (kind, object id, other) -> first position in the log
    for position, (kind, what, where) in enumerate(fake.log):
        at.setdefault((kind, id(what) if kind != "run" else what, id(where)), position)
    runs = {what: (position, where) for position, (kind, what, where) in enumerate(fake.log) if kind == "run"}
    for node in nodes:
        entry = book.entry(node.id)
        if not node.lane.on_gpu:
            assert entry is None
            for dep in (by_id[d] for d in node.deps if by_id[d].lane.on_gpu):
                produced = book.entry(dep.id)[1]
                syncs = [p for p, (k, e, _) in enumerate(fake.log) if k == "sync" and e is produced]
                assert syncs and min(syncs) < runs[node.id][0], f"{node.id} ran before producer {dep.id}"
            continue
        begin, end, stream = entry
        position, current = runs[node.id]
        assert current is stream, f"node {node.id} ran off its lane's stream"
        recorded = at[("record", id(begin), id(stream))]
        assert recorded < position < at[("record", id(end), id(stream))]
        for dep in map(by_id.get, node.deps):
            if not dep.lane.on_gpu:
                continue
            waited = ("wait", id(stream), id(book.entry(dep.id)[1]))
            if dep.lane is node.lane:
                assert waited not in at, f"{node.id} waits on {dep.id} of its own stream"
            else:
                assert at.get(waited, recorded) < recorded, f"{node.id} does not wait for {dep.id}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2-MoE (shared expert and its gate: every kind of layer tensor)."""
    return load_model(save_hf(hf_model("qwen2_moe"), tmp_path_factory.mktemp("fake-cuda") / "qwen"))


def test_routing_reaches_the_host_by_one_event_and_matches_the_gate(model) -> None:
    """A gate on CUDA leaves its routing on the device and an event; the host waits for that event
    alone (no device or stream sync), gets the same routing as the eager gate, and the event goes
    back to the pool."""
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_worker, "cuda", fake)
        book = cuda_worker.EventBook(torch.device("cuda"))
        devices = Devices(torch.device("cpu"))
        weights = DeviceWeights(model, devices)
        weights.setup(Residency.everything(model.spec), 0)
        routings = Routings(model, devices, book)
        x = torch.randn(7, model.spec.hidden, generator=torch.Generator().manual_seed(1))  # [T, hidden]
        fake.log.clear()
        routings.gate((0, 0), x, 0, weights.layer(0))
        assert [kind for kind, *_ in fake.log] == ["record"]  # nothing waited for yet
        counts = routings.counts(RoutingRequest(0, 0, after=0))
        assert [kind for kind, *_ in fake.log] == ["record", "sync"]  # the gate's event, nothing else
        assert fake.log[1][1] is fake.log[0][1] and fake.log[1][1] in book._free
        assert fake.log[1][1].blocking  # the host sleeps on it rather than spin (devices/cuda.py)
    routing, eager = routings.decided((0, 0)), model.gate(0, x)
    assert counts.counts == tuple(eager.counts().items())
    assert routing.experts == eager.experts
    for expert in eager.experts:
        assert torch.equal(routing.tokens[expert], eager.tokens[expert])
        assert torch.equal(routing.scales[expert], eager.scales[expert])


def test_each_layer_is_packed_into_one_registered_arena(model) -> None:
    """Pinned memory in one arena per layer (not one pin_memory() per tensor): every tensor of a
    layer becomes an aligned view of its layer's buffer with the same values; a second runtime on
    the same model registers nothing again."""
    before = [[t.clone() for t in _tensors(lw)] for lw in model.weights.layers]
    registered: list[torch.Tensor] = []
    arenas = pin_layers(model, register=registered.append)
    assert [a.data_ptr() for a in arenas] == [a.data_ptr() for a in registered]
    assert len(arenas) == model.spec.layers
    for lw, arena, old in zip(model.weights.layers, arenas, before, strict=True):
        tensors = _tensors(lw)
        assert arena.numel() == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
        for tensor, value in zip(tensors, old, strict=True):
            assert tensor.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert (tensor.data_ptr() - arena.data_ptr()) % ALIGN == 0
            assert torch.equal(tensor, value)
    assert pin_layers(model, register=registered.append) == [] and len(registered) == len(arenas)


def _tensors(lw) -> list[torch.Tensor]:
    ffns = [*lw.experts, *(f for f in (lw.shared, lw.dense) if f is not None)]
    attn = [getattr(lw.attn, f.name) for f in attrs.fields(type(lw.attn))]
    return [
        t
        for t in (*(t for f in ffns for t in f.tensors()), *attn, lw.router, lw.router_bias, lw.shared_gate)
        if t is not None
    ]


def _on_fake_cuda(model, name: str, policy: Policy) -> tuple[list, FakeCuda, Runtime, Any]:
    """`name`'s results through the CUDA stream workers, their events and the asynchronous routing
    hand-off on the fake CUDA (tensors stay on the CPU), with the fake's log, the closed runtime and
    its event book."""
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_worker, "cuda", fake)
        workers, events = make_workers(torch.device("cuda"))
        devices = Devices(torch.device("cpu"))
        plugin = create(name, SchedulerContext(model.spec, policy, NodeFactory(model.spec)))
        weights = DeviceWeights(model, devices)
        weights.setup(plugin.residency(), plugin.weight_buffer_bytes(), ends=plugin.uses_gpu())
        runtime = Runtime(model, plugin, devices, weights, workers, events, Trace(name=name))
        try:
            (results, _) = generate(model, runtime)
        finally:
            runtime.close()
    return results, fake, runtime, events


@pytest.mark.parametrize("name", gpu_schedulers())
def test_the_cuda_host_path_gives_eager_tokens(model, name: str) -> None:
    """Every scheduler through the CUDA host path (the fake's) gives eager's tokens."""
    (reference, _) = run_eager(model)
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5)
    results, fake, _, events = _on_fake_cuda(model, name, policy)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert any(kind == "wait" for kind, *_ in fake.log) or name == "eager"
    assert not events._events  # every step gave its events back


def test_the_cpu_scheduler_on_a_cuda_host_leaves_the_gpu_alone(model) -> None:
    """A CPU-only schedule where CUDA is there: eager's tokens from the host lane alone, no embedding
    or head copied to the device, no node run on a stream or waited for there."""
    (reference, _) = run_eager(model)
    results, fake, runtime, _ = _on_fake_cuda(model, "cpu", Policy(micro_batch_size=3, micro_batches=2))
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert runtime.weights.embed is None and runtime.weights.head is None
    assert not any(kind in ("run", "wait") for kind, *_ in fake.log)  # a step's bookkeeping events alone
    assert {s.node.lane for s in runtime.trace.spans} <= {Lane.CPU_COMPUTE}


def test_gpu_memory_caps_the_caching_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu-memory 16GiB on an 80 GiB GPU: the allocator may hold a fifth of it; no budget lifts it."""
    fractions: list[float] = []
    properties = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    for budget in (16 * 2**30, 200 * 2**30, None):
        cap_allocator(torch.device("cuda"), budget)
    assert fractions == [0.2, 1.0, 1.0]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(1, 3))
def test_the_compute_lane_launches_at_most_run_ahead_nodes_ahead(nodes: list[TaskNode], bound: int) -> None:
    """With FLOWMOE_CUDA_RUN_AHEAD=N, the compute lane's thread waits on the end event of its node N
    launches back before it begins the next (a blocking event: it sleeps), never on an event of an
    earlier step (back in the pool, maybe recorded again); the copy lanes are not held; the order
    stays the executor's."""
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_worker, "cuda", fake)
        patch.setenv(cuda_worker.RUN_AHEAD, str(bound))
        workers, book = make_workers(torch.device("cuda"))
        try:
            for _ in range(2):  # the second step draws the first step's events from the pool
                fake.log.clear()
                run_step(nodes, workers, fake)
                check(nodes, fake, book)
                check_run_ahead(nodes, fake, book, bound)
                book.end_step(None)
        finally:
            for worker in {id(w): w for w in workers.values()}.values():
                worker.close()


def check_run_ahead(nodes: list[TaskNode], fake: FakeCuda, book: cuda_worker.EventBook, bound: int) -> None:
    """Each bounded lane's node waited on the end of its node `bound` back before its begin event, and
    the lane threads waited on nothing else."""
    log = fake.log
    waited = {id(e): p for p, (k, e, who) in enumerate(log) if k == "sync" and who.startswith("flowmoe-cuda")}
    position = {id(e): p for p, (k, e, _) in enumerate(log) if k == "record"}
    expected = 0
    for lane in cuda_worker.BOUNDED_LANES:
        on_lane = [n for n in nodes if n.lane is lane]
        for back, node in zip(on_lane, on_lane[bound:], strict=False):
            end = book.entry(back.id)[1]
            assert end.blocking and waited[id(end)] < position[id(book.entry(node.id)[0])], (
                f"{node.id} ran ahead"
            )
            expected += 1
    assert len(waited) == expected  # those waits alone: none on an earlier step's events, none on copy lanes


def test_a_bad_run_ahead_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_worker.RUN_AHEAD, "two")
    with pytest.raises(ConfigError, match="FLOWMOE_CUDA_RUN_AHEAD='two': a whole number"):
        cuda_worker.run_ahead_setting()
    monkeypatch.setenv(cuda_worker.RUN_AHEAD, "")
    assert cuda_worker.run_ahead_setting() == cuda_worker.DEFAULT_RUN_AHEAD  # unset or empty: the default
    monkeypatch.setenv(cuda_worker.RUN_AHEAD, "0")
    assert cuda_worker.run_ahead_setting() == 0  # unbounded
