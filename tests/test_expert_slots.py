"""The device's experts in one pool of slots (runtime/expert_slots.py), checked on the CPU with a "GPU"
that is another device (cpu:0: the copying path, bytes comparable): each copy lands in a slot, a
group of experts on the device is one strided view (the grouped GEMM's operand), the pool is what
the accounting charges, an evicted slot is reused (after its eviction's event, on the fake CUDA),
close() releases it, and every scheduler gives eager's tokens with it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import flowmoe.devices.cuda as cuda_worker
import flowmoe.runtime.expert_slots as expert_slots
import flowmoe.runtime.lane_weights as lane_weights
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import NodeFactory, Residency, SchedulerContext
from flowmoe.devices.factory import make_workers
from flowmoe.kernels.grouped_experts import stacked
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.device_weights import Devices, DeviceWeights, held_bytes
from flowmoe.runtime.expert_slots import ExpertSlots
from flowmoe.runtime.lane_weights import LaneWeights
from flowmoe.runtime.pinned import pin_layers
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import create
from flowmoe.traces.trace import Trace
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import generate, gpu_schedulers, run_eager
from tests.test_fake_cuda import FakeCuda
from tests.test_grouped_experts import torch_ops_only  # noqa: F401  # a fixture, used by name

COPYING = Devices(torch.device("cpu", 0))  # not the host's "cpu": weights are copied, as to a GPU


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    model = load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("slots") / "mixtral"))
    pin_layers(model, register=lambda arena: None)  # packed as the runtime packs them on CUDA
    return model


def test_copies_land_in_slots_a_group_is_one_view_and_the_pool_is_what_is_charged(model: MoEModel) -> None:
    spec = model.spec
    weights = DeviceWeights(model, COPYING)
    residency = Residency(Residency.dense_only(spec).dense, frozenset({(0, 3)}))
    weights.setup(residency, 2 * spec.expert_bytes)
    pool = weights._pool
    assert pool is not None and pool.slots == 3 and pool.pool.nbytes == 3 * spec.expert_bytes
    weights.load(0, 1, 0, 5, 2)  # paged, in two runs
    weights.load(0, 1, 2, 5, 3)
    weights.load(0, 5)  # whole
    assert weights.nbytes - sum(lw.dense_nbytes for lw in model.weights.layers) == pool.pool.nbytes
    group = [weights.expert(0, e) for e in (1, 3, 5)]
    for e, ffn in zip((1, 3, 5), group, strict=True):
        for host, device in zip(model.weights.layers[0].experts[e].tensors(), ffn.tensors(), strict=True):
            assert torch.equal(host, device)
        assert weights.pooled(0, e)
    ordered = sorted(group, key=lambda f: f.gate_up.data_ptr())
    view = stacked([f.gate_up for f in ordered])
    assert view is not None and view[0].shape[0] == 3
    assert all(torch.equal(view[0][s], f.gate_up) for s, f in zip(view[1], ordered, strict=True))
    slot = weights._slots[(0, 5)]
    weights.evict(0, 5)
    weights.load(1, 2)  # the freed slot, reused
    assert weights._slots[(1, 2)] == slot and torch.equal(
        weights.expert(1, 2).down, model.weights.layers[1].experts[2].down
    )
    weights.close()


def _grouped_view(weights: DeviceWeights) -> weakref.ref[torch.Tensor]:
    """A group's view made (and kept on the pool, as the grouped path keeps it); the pool, weakly."""
    assert weights._pool is not None
    assert (
        stacked(sorted((weights.expert(0, e).gate_up for e in (1, 3)), key=torch.Tensor.data_ptr)) is not None
    )
    return weakref.ref(weights._pool.pool)


def test_close_releases_the_pool(model: MoEModel) -> None:
    weights = DeviceWeights(model, COPYING)
    weights.setup(
        Residency(Residency.dense_only(model.spec).dense, frozenset({(0, 3)})), model.spec.expert_bytes
    )
    weights.load(0, 1)
    pool = _grouped_view(weights)
    weights.close()
    gc.collect()
    assert pool() is None and weights.nbytes == 0


def test_no_pool_where_a_dense_part_is_copied_in_or_switched_off(
    model: MoEModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer that also holds dense parts could not be slots of experts alone: no pool, today's path."""
    streamed = DeviceWeights(model, COPYING)
    streamed.setup(Residency(frozenset({0}), frozenset()), 2 * model.spec.expert_bytes)
    assert streamed._pool is None
    monkeypatch.setenv("FLOWMOE_EXPERT_SLOTS", "0")
    off = DeviceWeights(model, COPYING)
    off.setup(Residency.dense_only(model.spec), 2 * model.spec.expert_bytes)
    assert off._pool is None
    for weights in (streamed, off):
        weights.close()


def test_a_reused_slot_waits_for_its_eviction_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (the fake): EVICT records the slot's event on its lane's stream; the copy that takes the
    slot next waits for it on its own stream, and nothing waits on the host."""
    fake = FakeCuda()
    monkeypatch.setattr(expert_slots, "cuda", fake)
    pool = ExpertSlots(torch.empty(2 * 64, dtype=torch.uint8), 64, cuda=True, free=[1, 0])
    compute, h2d = fake.Stream(), fake.Stream()
    slot = pool.take()
    assert not fake.log  # a fresh slot: nothing to wait for
    fake.set_stream(compute)
    pool.give(slot)
    fake.set_stream(h2d)
    assert pool.take() == slot and pool.room(slot).data_ptr() == pool.pool.data_ptr()
    (kind, event, on), (wait, stream, waited) = fake.log
    assert (kind, on, wait, stream, waited) == ("record", compute, "wait", h2d, event)
    pool.take()  # the other, fresh slot
    assert len(fake.log) == 2


@pytest.mark.usefixtures("torch_ops_only")  # else the C kernels take a few fp32 rows first
@pytest.mark.parametrize("name", gpu_schedulers())
def test_every_scheduler_gives_eager_tokens_with_the_pool(model: MoEModel, name: str) -> None:
    (reference, _) = run_eager(model)
    workers, events = make_workers(COPYING.gpu)
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5)
    plugin = create(name, SchedulerContext(model.spec, policy, NodeFactory(model.spec)))
    weights = DeviceWeights(model, COPYING)
    weights.setup(plugin.residency(), plugin.weight_buffer_bytes())
    gc.collect()
    before = held_bytes(COPYING.gpu)
    runtime = Runtime(model, plugin, COPYING, weights, workers, events, Trace(name=name))
    try:
        (results, _) = generate(model, runtime)
        pool = weights._pool
        grouped = pool is not None and "grouped_views" in pool.pool.__dict__  # a group ran on its view
    finally:
        runtime.close()
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    # klotski and moe-gen (--stream-dense 1) copy dense parts in: their buffer is not slots alone
    assert (pool is None) == (name in ("klotski", "moe-gen"))
    assert grouped or name in ("klotski", "moe-gen")  # MoE-Gen's nodes are one expert over micro-batches
    assert held_bytes(COPYING.gpu) <= before


@pytest.mark.usefixtures("torch_ops_only")
@pytest.mark.parametrize("name", ["cgopipe", "fiddler", "lru-cache", "prefetch-all"])
def test_cuda_lanes_group_the_experts_whose_copies_their_stream_can_wait_for(
    model: MoEModel, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CUDA stream worker and its events (the fake CUDA; weights copied to cpu:0, in the
    pool): a GPU expert node takes the experts of its group whose copies have been launched, its stream
    waits for those copies' events, the host waits for none of it, and the tokens are eager's."""
    (reference, _) = run_eager(model)
    fake = FakeCuda()
    monkeypatch.setattr(cuda_worker, "cuda", fake)
    monkeypatch.setattr(lane_weights, "cuda", fake)
    monkeypatch.setenv(cuda_worker.RUN_AHEAD, "0")  # the bound's own waits (tests/test_fake_cuda.py) apart
    workers, events = make_workers(torch.device("cuda"))
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5)
    plugin = create(name, SchedulerContext(model.spec, policy, NodeFactory(model.spec)))
    weights = DeviceWeights(model, COPYING)
    weights.setup(plugin.residency(), plugin.weight_buffer_bytes())
    runtime = Runtime(model, plugin, COPYING, weights, workers, events, Trace(name=name))
    try:
        (results, _) = generate(model, runtime)
        pool = weights._pool
        grouped = pool is not None and "grouped_views" in pool.pool.__dict__
    finally:
        runtime.close()
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert grouped
    gpu_threads = [who for kind, _, who in fake.log if kind == "sync" and who.startswith("flowmoe-cuda")]
    assert not gpu_threads  # no GPU lane waits on the host


def test_a_node_takes_another_expert_only_once_its_copies_are_launched_and_waits_on_the_device(
    model: MoEModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LaneWeights.taken on CUDA (the fake): expert 2 (in the pool) joins expert 1's call only once its
    own producer (its copy, on gpu.h2d) has been launched; then node 1's stream waits for that copy's
    end event, and for nothing it waits for itself or that its own stream orders."""
    monkeypatch.delenv("FLOWMOE_GROUPED_EXPERTS", raising=False)
    fake = FakeCuda()
    monkeypatch.setattr(cuda_worker, "cuda", fake)
    monkeypatch.setattr(lane_weights, "cuda", fake)
    events = cuda_worker.EventBook(torch.device("cuda", 0))
    weights = DeviceWeights(model, COPYING)
    weights.setup(Residency.dense_only(model.spec), 2 * model.spec.expert_bytes)
    weights.load(0, 1)
    weights.load(0, 2)
    factory = NodeFactory(model.spec)
    gate = factory.node(Op.GATE, Lane.GPU_COMPUTE, 0)
    copy = factory.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=2)
    other = factory.node(Op.EVICT, Lane.GPU_COMPUTE, 0, expert=0)  # on node 1's own stream
    mine = factory.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, expert=1, deps=[gate.id])
    theirs = factory.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, expert=2, deps=[gate.id, copy.id, other.id])
    lanes = LaneWeights(model, weights, events)
    compute, h2d = fake.Stream(), fake.Stream()
    fake.set_stream(compute)
    fake.log.clear()
    assert lanes.taken(mine, theirs) is None and not fake.log  # its copy not launched yet
    for node, stream in ((gate, compute), (copy, h2d), (other, compute)):
        events.put(node.id, fake.Event(), fake.Event(), stream)
    fake.log.clear()
    ffn = lanes.taken(mine, theirs)
    assert ffn is not None and ffn.gate_up.data_ptr() == weights.expert(0, 2).gate_up.data_ptr()
    assert fake.log == [("wait", compute, events.entry(copy.id)[1])]  # type: ignore[index]
    assert lanes.taken(mine, mine) is weights.expert(0, 1)
    monkeypatch.setenv("FLOWMOE_GROUPED_EXPERTS", "0")  # no grouped GEMM: each expert at its own node
    assert lanes.taken(mine, theirs) is None
    weights.close()
    events.close()
