"""A long job runs in bounded memory: 2,000 decode steps through the dataflow runtime (weights paged
in and evicted every step) keep nothing per node once warm, so the process's resident set stays
flat. (Before: the run's trace kept every span and memory counter of the job.)"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Sequence

import pytest
import torch

from flowmoe.core.policy import Policy
from flowmoe.jobs.engine import Engine, Request, StepInput
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.actions import StepState
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import available
from tests.hf_models import COMMON, FAMILY_CONFIGS, hf_model, save_hf
from tests.schedule_fixtures import run_scheduler

STEPS = 2_000
WARM = 200  # steps before the first reading: allocator pools, caches and torch's own warm-up
GROWTH_BOUND = 6 * 2**20  # bytes; keeping the trace grows the process by ~15 MiB over these steps


def rss() -> int:
    """Resident set of this process, bytes (/proc/self/statm: pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    """The tests' tiny Mixtral cut to one layer (2,000 steps in a few seconds)."""
    import transformers

    _, extra = FAMILY_CONFIGS["mixtral"]
    config = transformers.MixtralConfig(**{**COMMON, **extra, "num_hidden_layers": 1})
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    return load_model(save_hf(hf, tmp_path_factory.mktemp("bounded") / "mixtral"))


def long_job(model: MoEModel, record: bool) -> tuple[int, int, Runtime]:
    """-> (RSS after warm-up, RSS at the end, the runtime) of one sequence decoding STEPS tokens."""
    policy = Policy(micro_batch_size=1, micro_batches=1, weights_gpu_share=0.0)
    runtime = Runtime.create(model, "on-demand", policy, device="cpu", record=record)
    readings: list[int] = []

    async def step(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        out = await runtime(m, inputs)
        if runtime.steps in (WARM, STEPS):
            gc.collect()
            readings.append(rss())
        return out

    async def go() -> None:
        engine = Engine(model, step, max_new_tokens=STEPS)
        mb = engine.micro_batch(0, [Request("long", (3, 4, 5), 0)])
        async for _ in engine.run_batch([mb]):
            pass

    try:
        asyncio.run(go())
    finally:
        runtime.close()
    return readings[0], readings[-1], runtime


def test_a_long_job_keeps_nothing_per_node(model: MoEModel) -> None:
    warm, end, runtime = long_job(model, record=False)
    assert runtime.steps == STEPS
    assert not runtime.trace.spans and not runtime.trace.counters
    assert end - warm < GROWTH_BOUND, f"RSS grew {(end - warm) / 2**20:.1f} MiB after warm-up"


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("layered") / "mixtral"))


@pytest.mark.parametrize("name", sorted(available()))
def test_a_step_keeps_only_its_last_layer_alive(layered: MoEModel, name: str, monkeypatch) -> None:
    """Intermediates die with their last reader, not at the step's end: after a step, what is left
    per micro-batch is its hidden state, the last layer's x and logits (and no KV working copy)."""
    states: list[StepState] = []
    create = StepState.create

    def recording(*args, **kwargs) -> StepState:
        states.append(create(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(StepState, "create", recording)
    run_scheduler(layered, name, Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5))
    last = layered.spec.layers - 1
    for state in states:
        acts = state.acts
        assert not (acts.qkv or acts.attn or state.outputs or acts.shared or acts.x_cpu or acts.kv_work)
        assert {layer for layer, _ in acts.x} <= {last}
