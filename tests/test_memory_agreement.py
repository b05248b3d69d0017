"""One memory figure: the simulator's GPU and host memory of a run equal the runtime's check of the
same batch, for every registered scheduler at several policies (both call core.memory)."""

from __future__ import annotations

import pytest

from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.memory import host_memory
from flowmoe.core.policy import Policy
from flowmoe.core.workloads import LengthDistribution, Workload
from flowmoe.jobs.batching import BatchLimits, Request
from flowmoe.jobs.job import first_batch
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import available
from flowmoe.study.simulate import Setup, Simulation
from tests.hf_models import hf_model, save_hf

PROMPT, GEN = 12, 5
POLICIES = [
    Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0, kv_gpu_share=0.0),
    Policy(micro_batch_size=4, micro_batches=2, weights_gpu_share=0.5, kv_gpu_share=0.5),
    Policy(
        micro_batch_size=2, micro_batches=3, weights_gpu_share=0.25, kv_gpu_share=0.67, attention_on="cpu"
    ),
    Policy(micro_batch_size=5, micro_batches=1),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("agreement") / "mixtral"))


def simulation(model: MoEModel, policy: Policy) -> Simulation:
    """Prompts of one length, so the engine's balanced micro-batches are the simulator's in-order ones."""
    workload = Workload("fixed", LengthDistribution(PROMPT, PROMPT, PROMPT), GEN)
    return Simulation(Setup(model.spec, hardware("t4"), workload, policy))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"mu{p.micro_batch_size}x{p.micro_batches}")
@pytest.mark.parametrize("name", sorted(available()))
def test_the_simulator_and_the_runtime_count_the_same_memory(
    model: MoEModel, name: str, policy: Policy
) -> None:
    sim = simulation(model, policy)
    requests = [Request(str(i), tuple(range(3, 3 + PROMPT)), i) for i in range(policy.batch_size)]
    limits = BatchLimits(policy.micro_batches, policy.micro_batch_size, GEN)
    batch = first_batch(requests, limits)
    assert batch == sim.batch()
    try:
        simulated = sim.need(name)
    except ConfigError:  # a placement this scheduler does not take: the runtime refuses it too
        with pytest.raises(ConfigError):
            Runtime.create(model, name, sim.policy, device="cpu")
        return
    cost = RooflineCost(hardware("t4"), model.spec)
    with Runtime.create(model, name, sim.policy, device="cpu", cost=cost) as runtime:
        assert runtime.check_memory(batch) == simulated
        assert host_memory(runtime.scheduler, batch) == host_memory(sim.scheduler(name), batch)


def test_klotski_counts_its_gpu_kept_cache_layers_once(model: MoEModel) -> None:
    """The double count the simulator had (kv_gpu_layers and again as working bytes) is gone: the KV
    figure is the GPU-kept layers' share of the cache plus the working copies of the CPU-homed ones
    at the step where memory peaks (two micro-batches' slices of one layer)."""
    policy = Policy(micro_batch_size=4, micro_batches=2, weights_gpu_share=0.0, kv_gpu_share=0.67)
    sim = simulation(model, policy)
    spec, batch = model.spec, sim.batch()
    whole = batch.total_slots * spec.kv_bytes_per_token
    kept = len(sim.scheduler("klotski").kv_gpu_layers())
    assert 0 < kept < spec.layers
    need, klotski = sim.need("klotski"), sim.scheduler("klotski")
    copies = {klotski.kv_working_bytes(batch, step) for step in batch.steps()}
    assert need.kv_cache - kept * whole // spec.layers in copies
    assert max(copies) == 2 * 4 * (PROMPT + GEN - 1) * spec.kv_bytes_per_token // spec.layers
