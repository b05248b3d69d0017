"""The thread plan (flowmoe/core/threads.py): cores split over compute threads without oversubscribing
them, --cpu-threads checked against the usable cores, and every thread that computes set to its share."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.executor import Executor
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.threads import SPIN, plan_threads, usable_cores
from flowmoe.devices.factory import host_plan, make_workers
from flowmoe.devices.inline import InlineWorker
from flowmoe.devices.threadpool import LaneThreads, ThreadPoolWorker, set_intra_op

PROMPTS = Path(__file__).parent.parent / "examples" / "prompts.jsonl"


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The tests set this thread's torch threads; the suite's other tests keep theirs."""
    before = torch.get_num_threads()
    yield
    set_intra_op(before)


@given(
    cores=st.integers(1, 256),
    data=st.data(),
    compute=st.integers(1, 8),
    reserve=st.integers(0, 2),
)
def test_a_plan_never_oversubscribes(cores: int, data: st.DataObject, compute: int, reserve: int) -> None:
    budget = data.draw(st.none() | st.integers(1, cores))
    plan = plan_threads(cores, budget, compute, reserve)
    assert plan.budget == (budget or cores)
    assert 1 <= plan.compute_threads <= compute and plan.intra_op >= 1
    assert plan.busy <= plan.budget <= cores
    if plan.budget > reserve:  # the reserved cores are left to the launch threads
        assert plan.busy <= plan.budget - reserve
        assert plan.compute_threads == min(compute, plan.budget - reserve)


@pytest.mark.parametrize(
    ("cores", "budget", "compute", "reserve", "split"),
    [
        (2, None, 1, 0, (1, 2)),  # this machine without CUDA: the loop's thread computes on both cores
        (2, None, 2, 0, (2, 1)),  # two lanes computing at once: one core each
        (2, 1, 1, 0, (1, 1)),
        (16, None, 1, 1, (1, 15)),  # with CUDA: one core kept for the loop and launch threads
        (16, 12, 2, 1, (2, 5)),  # 11 cores over two lanes: 5 each, one idle rather than oversubscribed
        (2, 1, 1, 1, (1, 1)),  # a budget of one core computes with it, reserve or not
        (4, None, 8, 0, (4, 1)),  # more lanes than cores: the lanes share the cores' threads
    ],
)
def test_plan_examples(
    cores: int, budget: int | None, compute: int, reserve: int, split: tuple[int, int]
) -> None:
    plan = plan_threads(cores, budget, compute, reserve)
    assert (plan.compute_threads, plan.intra_op) == split


def test_the_default_budget_is_the_process_threads_up_to_the_cores() -> None:
    assert plan_threads(8, default=3).budget == 3  # OMP_NUM_THREADS=3
    assert plan_threads(2, default=16).budget == 2  # an environment asking for more than the cores
    assert plan_threads(2).budget == 2


@pytest.mark.parametrize("budget", [0, -1, 3, 1000])
def test_a_budget_outside_the_cores_is_refused(budget: int) -> None:
    with pytest.raises(ConfigError, match=rf"^--cpu-threads {budget}: must be in \[1, 2\], the cores"):
        plan_threads(2, budget)


WAIT_PROBE = """
import os, sys
from flowmoe.cli import main
assert "torch" not in sys.modules  # libgomp reads its wait policy once, when torch loads it
main(["--version"])
import torch
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize(
    ("given", "seen"),
    [
        (
            {},
            {("PASSIVE", "None"), ("None", str(SPIN))},
        ),  # sleeping on a busy machine, a short spin on a free one
        ({"OMP_WAIT_POLICY": "ACTIVE"}, {("ACTIVE", "None")}),
        ({"GOMP_SPINCOUNT": "5"}, {("None", "5")}),
    ],
)
def test_the_cli_chooses_how_openmp_workers_wait_unless_the_user_chose(
    given: dict[str, str], seen: set[tuple[str, str]]
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | given
    done = subprocess.run(
        [sys.executable, "-c", WAIT_PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert tuple(done.stdout.split()[-2:]) in seen


def test_usable_cores_follow_the_affinity() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.parametrize("value", ["0", "-3"])
def test_cpu_threads_below_one_is_a_usage_error(value: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--prompts", str(PROMPTS), "--output", "never.jsonl", "--cpu-threads", value]) == 2
    assert "--cpu-threads: must be an integer >= 1" in capsys.readouterr().err


def test_cpu_threads_above_the_cores_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out.jsonl"
    too_many = str(usable_cores() + 1)
    code = main(["run", "--prompts", str(PROMPTS), "--output", str(out), "--cpu-threads", too_many])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"flowmoe: error: --cpu-threads {too_many}: must be in [1, {usable_cores()}], the cores "
                   "this process may use (os.sched_getaffinity); more threads than cores only "
                   "oversubscribe them"]  # fmt: skip
    assert not out.exists()


def test_a_lane_thread_computes_with_its_share_and_leaves_other_threads_alone() -> None:
    set_intra_op(2)
    seen: dict[Lane, int] = {}
    done = threading.Event()

    def serve(node: TaskNode, action: object, finish: object) -> None:
        seen[node.lane] = torch.get_num_threads()
        done.set()

    lanes = LaneThreads(serve, intra_op=1)
    lanes.put(TaskNode(0, Op.GATE, Lane.CPU_COMPUTE), None, lambda *_: None)
    assert done.wait(30)
    lanes.close()
    assert seen == {Lane.CPU_COMPUTE: 1}
    assert torch.get_num_threads() == 2  # the lane's setting did not reach this thread


def test_a_thread_pool_worker_gives_each_lane_its_threads() -> None:
    counts: list[int] = []
    worker = ThreadPoolWorker(3)

    async def go() -> None:
        executor = Executor(dict.fromkeys(Lane, worker))
        for i, lane in enumerate((Lane.GPU_COMPUTE, Lane.CPU_COMPUTE)):
            executor.submit(TaskNode(i, Op.GATE, lane), lambda: counts.append(torch.get_num_threads()))
        await executor.drain()

    try:
        asyncio.run(go())
    finally:
        worker.close()
    assert counts == [3, 3]


def test_without_cuda_every_lane_runs_on_the_loop_thread_with_the_plan() -> None:
    set_intra_op(1)
    workers, events = make_workers(torch.device("cpu"), threads=usable_cores())
    assert events is None and {type(w) for w in workers.values()} == {InlineWorker}
    ran: list[tuple[int, int]] = []

    async def go() -> None:
        executor = Executor(workers)
        for i, lane in enumerate(Lane):
            action = lambda: ran.append((threading.get_ident(), torch.get_num_threads()))  # noqa: E731
            executor.submit(TaskNode(i, Op.GATE, lane), action)
        await executor.drain()

    asyncio.run(go())
    assert ran == [(threading.get_ident(), usable_cores())] * len(Lane)
    assert host_plan(torch.device("cpu"), 1).intra_op == 1


def test_an_interrupt_inside_an_inline_node_fails_it_and_goes_on() -> None:
    """Ctrl-C raised inside an action: the lane is not left busy, and the interrupt leaves the loop."""
    worker = InlineWorker()

    def interrupted() -> None:
        raise KeyboardInterrupt

    async def go() -> Executor:
        executor = Executor({Lane.GPU_COMPUTE: worker})
        executor.submit(TaskNode(0, Op.GATE, Lane.GPU_COMPUTE), interrupted)
        executor.submit(TaskNode(1, Op.GATE, Lane.GPU_COMPUTE, deps=(0,)), lambda: None)
        try:
            await executor.drain()
        finally:
            await executor.settle()  # returns: nothing is left running
        return executor

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(go())
