"""A closed runtime holds nothing: its device weights are gone (weak references die), its share of
the process's GPU ledger is returned, its lanes' threads stop; so runtimes created and closed one
after another run under one --gpu-memory budget, and one left open is named, not an allocator OOM."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from flowmoe.core.errors import MemoryBudgetError
from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.device_weights import held_bytes
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import available
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import generate, run_eager


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("release") / "mixtral"))


def test_close_drops_every_device_weight_and_thread(model: MoEModel) -> None:
    threads, cpu = threading.active_count(), torch.device("cpu")
    gc.collect()
    before = held_bytes(cpu)  # what runtimes of other tests still hold
    runtime = Runtime.create(model, "eager", Policy(micro_batch_size=3, micro_batches=2), device="cpu")
    generate(model, runtime)
    weights = runtime.weights
    spec = model.spec
    refs = [weakref.ref(weights.layer(layer)) for layer in range(spec.layers)]
    refs += [
        weakref.ref(weights.expert(layer, e)) for layer in range(spec.layers) for e in range(spec.moe.experts)
    ]
    assert held_bytes(cpu) > before and weights.nbytes > 0
    runtime.close()
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert weights.nbytes == 0 and weights.embed is None and weights.head is None
    assert held_bytes(cpu) == before
    assert threading.active_count() <= threads and not runtime.workers
    runtime.close()  # twice: nothing more to do


def test_every_scheduler_back_to_back_under_one_budget(model: MoEModel) -> None:
    """Each scheduler's runtime in turn, in a with block, under a budget that holds one at a time; each
    gives eager's tokens."""
    reference, _ = run_eager(model)
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5)
    gc.collect()
    leftover = held_bytes(torch.device("cpu"))  # what runtimes of other tests still hold
    with Runtime.create(model, "eager", policy, device="cpu") as probe:
        one = held_bytes(probe.devices.gpu) - leftover  # every weight resident, and a half again:
    budget = leftover + 3 * one // 2  # room for one runtime at a time, not two
    for name in sorted(available()):
        with Runtime.create(model, name, Policy(micro_batch_size=3, micro_batches=2, gpu_memory=budget),
                            device="cpu") as runtime:  # fmt: skip
            results, _ = generate(model, runtime)
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], name
        assert runtime.closed


def test_a_runtime_left_open_is_named_when_the_next_does_not_fit(model: MoEModel) -> None:
    first = Runtime.create(model, "eager", device="cpu")
    budget = held_bytes(first.devices.gpu)
    try:
        with pytest.raises(MemoryBudgetError, match=r"runtime\(s\) not closed still hold.*close\(\)"):
            Runtime.create(model, "eager", Policy(gpu_memory=budget), device="cpu")
    finally:
        first.close()
    with Runtime.create(model, "eager", Policy(gpu_memory=budget), device="cpu"):
        pass
