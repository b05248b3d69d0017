"""The executor keeps dependency order and lane order for any DAG, on every worker, and never hangs."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowmoe.core.errors import NodeFailed, PlanError
from flowmoe.core.executor import Executor, Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.scheduling import Residency
from flowmoe.devices.inline import InlineWorker
from flowmoe.devices.sim import SimWorker, run_virtual
from flowmoe.devices.threadpool import ThreadPoolWorker
from flowmoe.model.loading import load_model
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from tests.hf_models import hf_model, save_hf

LANES = list(Lane)


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 40) -> list[TaskNode]:
    """Random DAGs in emission order: each node on a random lane, deps on earlier nodes."""
    count = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(count):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        lane = draw(st.sampled_from(LANES))
        nodes.append(TaskNode(i, Op.EXPERT_FFN, lane, layer=i % 3, mb=i % 2, expert=i, deps=tuple(deps)))
    return nodes


def check_order(nodes: list[TaskNode], spans: list[Span], slack: float = 0.0) -> None:
    """Every node ran once, after its deps ended; each lane ran its nodes in emission order, one at a time.
    `slack`: how far a span dated on another clock (a GPU's, through an anchor) may be off the host's."""
    by_id = {s.node.id: s for s in spans}
    assert sorted(by_id) == [n.id for n in nodes]
    for node in nodes:
        for dep in node.deps:
            assert by_id[dep].end <= by_id[node.id].start + slack, f"{node.id} started before dep {dep} ended"
    for lane in LANES:
        on_lane = [by_id[n.id] for n in nodes if n.lane is lane]
        for prev, nxt in itertools.pairwise(on_lane):
            assert prev.end <= nxt.start, f"lane {lane}: {nxt.node.id} overlapped or overtook {prev.node.id}"


async def run_all(nodes: list[TaskNode], worker, actions=None, clock=time.perf_counter) -> list[Span]:
    executor = Executor(dict.fromkeys(Lane, worker), clock=clock)
    for node in nodes:
        executor.submit(node, (actions or {}).get(node.id))
    await executor.drain()
    return executor.spans


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_thread_pool_worker_keeps_order(nodes: list[TaskNode]) -> None:
    rng = random.Random(len(nodes))
    delays = {n.id: rng.random() * 2e-4 for n in nodes}
    actions = {n.id: (lambda d=delays[n.id]: time.sleep(d)) for n in nodes}
    worker = ThreadPoolWorker()
    try:
        spans = asyncio.run(run_all(nodes, worker, actions))
    finally:
        worker.close()
    check_order(nodes, spans)


@settings(max_examples=60, deadline=None)
@given(dags(max_nodes=80), st.randoms(use_true_random=False))
def test_sim_worker_keeps_order(nodes: list[TaskNode], rng: random.Random) -> None:
    costs = {n.id: rng.choice([0.0, 1e-3, 2.5e-3, 1.0]) for n in nodes}

    async def go() -> list[Span]:
        loop = asyncio.get_running_loop()
        return await run_all(nodes, SimWorker(lambda n: costs[n.id]), clock=loop.time)

    spans = run_virtual(go())
    check_order(nodes, spans)
    for span in spans:
        assert span.end - span.start == pytest.approx(costs[span.node.id])


@settings(max_examples=60, deadline=None)
@given(dags(max_nodes=80))
def test_inline_worker_keeps_order(nodes: list[TaskNode]) -> None:
    check_order(nodes, asyncio.run(run_all(nodes, InlineWorker())))


def test_inline_worker_runs_a_released_chain_in_one_loop_callback() -> None:
    """Nodes a finished node releases run in the same loop callback (one loop iteration for a chain,
    not one each): a ticker callback that re-arms itself never runs between them."""
    ticks, seen = [0], []

    def tick() -> None:
        ticks[0] += 1
        if ticks[0] < 1000:
            asyncio.get_running_loop().call_soon(tick)

    async def go() -> None:
        executor = Executor(dict.fromkeys(Lane, InlineWorker()))
        asyncio.get_running_loop().call_soon(tick)
        chain = [_node(i, LANES[i % len(LANES)], (i - 1,) if i else ()) for i in range(20)]
        for node in chain:
            executor.submit(node, lambda: seen.append(ticks[0]))
        await executor.drain()

    asyncio.run(go())
    assert len(seen) == 20 and len(set(seen)) == 1


def test_waiting_for_an_inline_node_runs_its_chain_on_the_spot() -> None:
    """The driver's wait runs the started inline nodes itself: no other loop callback runs before
    the node it waits for is done."""
    ticks = [0]

    def tick() -> None:
        ticks[0] += 1
        if ticks[0] < 1000:
            asyncio.get_running_loop().call_soon(tick)

    async def go() -> tuple[int, int]:
        executor = Executor(dict.fromkeys(Lane, InlineWorker()))
        asyncio.get_running_loop().call_soon(tick)
        await asyncio.sleep(0)
        before = ticks[0]
        for i in range(10):
            executor.submit(_node(i, LANES[i % len(LANES)], (i - 1,) if i else ()))
        await executor.wait(9)
        after = ticks[0]
        await executor.drain()
        return before, after

    before, after = asyncio.run(go())
    assert before == after


def test_inline_worker_leaves_a_closed_loops_queue_behind() -> None:
    """An interrupt that ends a loop with nodes still queued in the worker (their callback never
    runs once the loop is closed) does not stall the worker's next run on another loop."""
    worker, ran = InlineWorker(), []

    def interrupted() -> None:
        raise KeyboardInterrupt

    async def interrupted_run() -> None:
        executor = Executor(dict.fromkeys(Lane, worker))
        executor.submit(_node(0, Lane.GPU_COMPUTE), interrupted)
        executor.submit(_node(1, Lane.CPU_COMPUTE), lambda: ran.append(1))  # queued behind node 0
        await executor.drain()

    loop = asyncio.new_event_loop()
    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(interrupted_run())
    loop.close()
    assert ran == []

    async def next_run() -> list[Span]:
        return await asyncio.wait_for(run_all([_node(0, Lane.GPU_COMPUTE)], worker), timeout=30)  # hang guard

    assert [s.node.id for s in asyncio.run(next_run())] == [0]


def test_without_kept_spans_only_the_span_callback_sees_them() -> None:
    nodes = [_node(i, Lane.GPU_COMPUTE, (i - 1,) if i else ()) for i in range(5)]
    seen: list[Span] = []

    async def go(on_span) -> Executor:
        executor = Executor(dict.fromkeys(Lane, InlineWorker()), on_span=on_span, keep_spans=False)
        for node in nodes:
            executor.submit(node)
        await executor.drain()
        return executor

    assert asyncio.run(go(seen.append)).spans == []
    assert [s.node.id for s in seen] == [0, 1, 2, 3, 4] and all(s.end >= s.start >= s.queued for s in seen)
    assert asyncio.run(go(None)).spans == []


def test_sim_overlap_is_real_time_saving() -> None:
    """Two independent lanes overlap on the virtual clock: makespan is the longer lane."""
    nodes = [TaskNode(0, Op.PAGE_COPY, Lane.GPU_H2D), TaskNode(1, Op.GPU_ATTN, Lane.GPU_COMPUTE)]
    costs = {0: 3.0, 1: 2.0}

    async def go() -> list[Span]:
        return await run_all(nodes, SimWorker(lambda n: costs[n.id]), clock=asyncio.get_running_loop().time)

    spans = run_virtual(go())
    assert max(s.end for s in spans) == pytest.approx(3.0)


def _node(i: int, lane: Lane, deps: tuple[int, ...] = (), op: Op = Op.GATE) -> TaskNode:
    return TaskNode(i, op, lane, layer=1, mb=0, deps=deps)


def test_forward_references_resolve() -> None:
    """A node may name a dependency submitted after it."""
    nodes = [_node(0, Lane.GPU_COMPUTE, (1,)), _node(1, Lane.CPU_COMPUTE)]
    spans = asyncio.run(run_all(nodes, InlineWorker()))
    assert [s.node.id for s in spans] == [1, 0]


def test_dependency_cycle_is_reported() -> None:
    nodes = [_node(0, Lane.GPU_COMPUTE, (1,)), _node(1, Lane.CPU_COMPUTE, (0,))]
    with pytest.raises(PlanError, match=r"dependency cycle: 0 \(gate L1 mb0 on gpu.compute\) -> 1 .* -> 0"):
        asyncio.run(run_all(nodes, InlineWorker()))


def test_lane_order_deadlock_is_reported() -> None:
    """Node 0 waits for 2, which sits behind 1 on its lane; 1 waits for 0."""
    nodes = [_node(0, Lane.GPU_COMPUTE, (2,)), _node(1, Lane.CPU_COMPUTE, (0,)), _node(2, Lane.CPU_COMPUTE)]
    with pytest.raises(PlanError, match=r"deadlock \(lane order and dependencies wait on each other\)"):
        asyncio.run(run_all(nodes, InlineWorker()))


def test_unknown_dependency_is_reported() -> None:
    nodes = [_node(0, Lane.GPU_COMPUTE), _node(1, Lane.GPU_COMPUTE, (0, 7))]
    with pytest.raises(PlanError, match=r"node 1 \(gate L1 mb0\) depends on unknown node 7"):
        asyncio.run(run_all(nodes, InlineWorker()))


def test_submit_errors() -> None:
    async def go() -> None:
        executor = Executor({Lane.GPU_COMPUTE: InlineWorker()})
        executor.submit(_node(0, Lane.GPU_COMPUTE))
        with pytest.raises(PlanError, match="submitted twice"):
            executor.submit(_node(0, Lane.GPU_COMPUTE))
        with pytest.raises(PlanError, match=r"lane cpu\.compute, which has no worker"):
            executor.submit(_node(1, Lane.CPU_COMPUTE))
        with pytest.raises(PlanError, match="depends on itself"):
            executor.submit(_node(2, Lane.GPU_COMPUTE, (2,)))
        await executor.drain()

    asyncio.run(go())


def test_failure_names_the_node_and_stops_every_lane() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        time.sleep(0.002)
        with lock:
            ran.append(i)

    def boom() -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    nodes = [TaskNode(i, Op.PRE_ATTN, Lane.GPU_COMPUTE, layer=i, mb=0) for i in range(5)]
    nodes.append(TaskNode(5, Op.EXPERT_FFN, Lane.CPU_COMPUTE, layer=3, mb=1, expert=6))
    nodes += [TaskNode(6 + i, Op.COMBINE, Lane.CPU_COMPUTE, layer=3, mb=1, deps=(5,)) for i in range(3)]
    actions = {n.id: (lambda i=n.id: work(i)) for n in nodes}
    actions[5] = boom
    worker = ThreadPoolWorker()
    try:
        with pytest.raises(NodeFailed) as info:
            asyncio.run(run_all(nodes, worker, actions))
    finally:
        worker.close()
    message = str(info.value)
    expected = "expert_ffn L3 mb1 e6 on cpu.compute (node 5) failed: RuntimeError: CUDA out of memory"
    assert message.startswith(expected)
    assert not {6, 7, 8} & set(ran)  # nothing after the failure on its lane
    assert isinstance(info.value.__cause__, RuntimeError)


def test_cancel_stops_new_work_and_keeps_spans() -> None:
    async def go() -> Executor:
        executor = Executor({Lane.GPU_COMPUTE: ThreadPoolWorker()})
        for i in range(50):
            node = TaskNode(i, Op.GPU_ATTN, Lane.GPU_COMPUTE, deps=(i - 1,) if i else ())
            executor.submit(node, lambda: time.sleep(0.002))
        await asyncio.sleep(0.02)
        executor.cancel()
        with pytest.raises(asyncio.CancelledError):
            await executor.drain()
        return executor

    executor = asyncio.run(go())
    assert 0 < len(executor.spans) < 50
    assert executor.pending == 50 - len(executor.spans)


def test_waiting_for_a_node_never_submitted_is_reported() -> None:
    async def go() -> None:
        executor = Executor({Lane.GPU_COMPUTE: InlineWorker()})
        await executor.wait(3)

    with pytest.raises(PlanError, match="waiting for node 3, which was never submitted"):
        asyncio.run(go())


def _mixed(count: int) -> list[TaskNode]:
    """A chain hopping over four lanes, with a second dependency two nodes back."""
    lanes = [Lane.GPU_COMPUTE, Lane.GPU_H2D, Lane.CPU_COMPUTE, Lane.GPU_D2H]
    return [TaskNode(i, Op.GATE, lanes[i % 4], layer=i, deps=tuple(d for d in (i - 1, i - 2) if d >= 0))
            for i in range(count)]  # fmt: skip


async def _drain_with(executor: Executor, nodes: list[TaskNode]) -> None:
    for node in nodes:
        executor.submit(node, lambda: time.sleep(1e-4))
    await asyncio.wait_for(executor.drain(), timeout=30)  # a hang guard, not a timing assertion


def test_a_span_callback_that_raises_fails_the_run_naming_the_node() -> None:
    """An on_span that raises fails drain (NodeFailed naming the node), never leaves a lane busy."""

    def on_span(span: Span) -> None:
        if span.node.id == 37:
            raise RuntimeError("dictionary changed size during iteration")

    worker = ThreadPoolWorker()
    try:
        executor = Executor(dict.fromkeys(Lane, worker), on_span=on_span)
        with pytest.raises(NodeFailed, match=r"gate L37 on gpu.h2d \(node 37\) failed in its span callback: "
                                             r"RuntimeError: dictionary changed size"):  # fmt: skip
            asyncio.run(_drain_with(executor, _mixed(200)))
    finally:
        worker.close()
    assert 37 not in {s.node.id for s in executor.spans}
    assert all(s.node.id < 37 + 4 for s in executor.spans)  # nothing downstream of 37 started after it


class _Refusing:
    """A worker that cannot take node 5 (as a pool after shutdown cannot)."""

    def __init__(self) -> None:
        self._inline = InlineWorker()

    def start(self, node: TaskNode, action, finish) -> None:
        if node.id == 5:
            raise RuntimeError("cannot schedule new futures after shutdown")
        self._inline.start(node, action, finish)

    def close(self) -> None:
        pass


def test_a_worker_that_cannot_start_a_node_fails_the_run() -> None:
    executor = Executor(dict.fromkeys(Lane, _Refusing()))
    with pytest.raises(NodeFailed, match=r"\(node 5\) could not start: RuntimeError: cannot schedule"):
        asyncio.run(_drain_with(executor, _mixed(20)))


class _Interrupted(_Refusing):
    """Ctrl-C arrives while node 5 is handed to its worker."""

    def start(self, node: TaskNode, action, finish) -> None:
        if node.id == 5:
            raise KeyboardInterrupt
        self._inline.start(node, action, finish)


def test_an_interrupt_while_a_node_starts_fails_the_run_and_goes_on() -> None:
    """The run is failed (nothing waits on it) and the interrupt, not a NodeFailed, leaves the loop:
    the command exits as interrupted (130), not with an error line."""
    executor = Executor(dict.fromkeys(Lane, _Interrupted()))
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(_drain_with(executor, _mixed(20)))
    with pytest.raises(NodeFailed, match=r"\(node 5\) could not start: KeyboardInterrupt"):
        executor.submit(TaskNode(99, Op.GATE, Lane.GPU_COMPUTE))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("executor") / "mixtral"))


def test_residency_counters_hold_under_concurrent_lanes(tiny_model) -> None:
    """Eight threads copy (in pages) and evict their own experts while two more read the counters
    and the resident weights: no error, the counters stay within bounds, and they end where they began.
    (Before: nbytes walked the dicts the other threads changed: 'dictionary changed size'.)"""
    weights = DeviceWeights(tiny_model, Devices(torch.device("cpu")))
    spec = tiny_model.spec
    keys = [(layer, expert) for layer in range(spec.layers) for expert in range(spec.moe.experts)]
    sizes = {k: tiny_model.weights.layers[k[0]].experts[k[1]].nbytes for k in keys}
    weights.setup(Residency(dense=frozenset(range(spec.layers))), sum(sizes.values()))
    base, ceiling = weights.nbytes, weights.nbytes + sum(sizes.values())
    errors: list[BaseException] = []
    stop = threading.Event()

    def lane(own: list[tuple[int, int]]) -> None:
        try:
            for round_ in range(150):
                for layer, expert in own:
                    parts = 1 + round_ % 3
                    for part in range(parts):
                        weights.load(layer, expert, part, parts)
                    assert weights.expert(layer, expert) is not None
                for layer, expert in own:
                    weights.evict(layer, expert)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                assert base <= weights.nbytes <= ceiling
                assert 0 <= weights.resident_experts <= len(keys)
                weights.layer(0)
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    lanes = [threading.Thread(target=lane, args=(keys[i::8],)) for i in range(8)]
    for thread in readers + lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    assert not errors, errors[0]
    assert weights.nbytes == base and weights.resident_experts == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_cuda_stream_worker_keeps_order_on_the_gpu(nodes: list[TaskNode]) -> None:
    """On CUDA, node times are the GPU's own (CUDA events): dependency and lane order hold there."""
    from flowmoe.devices.factory import make_workers

    device = torch.device("cuda")
    workers, events = make_workers(device)
    actions = {n.id: (lambda: torch.cuda._sleep(20_000)) if n.lane.on_gpu else (lambda: time.sleep(1e-4))
               for n in nodes}  # fmt: skip

    async def go() -> list[Span]:
        executor = Executor(workers)
        for node in nodes:
            executor.submit(node, actions[node.id])
        await executor.drain()
        return executor.spans

    try:
        spans = asyncio.run(go())
        slack = events.anchor_slack  # the anchor's host time is late by at most this
        check_order(nodes, events.end_step(spans), slack)
    finally:
        for worker in {id(w): w for w in workers.values()}.values():
            worker.close()
