"""A real run does what the plan prices: klotski's GPU-kept cache layers live and are attended on the
GPU (the rest on the CPU, copied in per batch), and moe-gen runs each routed expert once over the
tokens of every micro-batch of its expert group, in chunks of the plan's GEMM rows."""

from __future__ import annotations

import math

import pytest
import torch

import flowmoe.runtime.actions as actions
import flowmoe.schedulers.moe_gen as moe_gen
from flowmoe.core.plan import Op
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.kernels.kv_cache import KVCache
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.device_weights import Devices
from flowmoe.runtime.runner import Runtime
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import generate, run_eager

KLOTSKI = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0, kv_gpu_share=0.67, group_size=2)
MOE_GEN = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "deepseek_v2_lite"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    return load_model(save_hf(hf_model(request.param), tmp_path_factory.mktemp("as-planned") / request.param))


@pytest.fixture(scope="module")
def eager(model: MoEModel):
    return run_eager(model)


def test_klotski_homes_the_caches_of_its_first_layers_on_the_gpu(
    model: MoEModel, eager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_gpu_share 0.67 of 3 layers: the engine allocates layers 0 and 1 of every micro-batch's cache
    on the runtime's GPU device and layer 2 on the CPU; attention reads layers 0 and 1 in place (their
    KV_LOAD copies nothing, their KV_STORE writes nothing back) and layer 2 from a working copy; the
    memory counters and check put those two layers on the GPU; eager's tokens."""
    homes: list[object] = []
    allocate = KVCache.allocate.__func__  # type: ignore[attr-defined]

    def allocating(cls, *args, **kwargs) -> KVCache:
        cache = allocate(cls, *args, **kwargs)
        homes.append((args[6] if len(args) > 6 else kwargs["device"], cache))
        return cache

    attended: list[tuple[int, torch.Tensor]] = []
    attention = MoEModel.attention

    def attending(self, layer, q, k, v, kv, layout, lw=None):
        attended.append((layer, kv[0]))
        return attention(self, layer, q, k, v, kv, layout, lw)

    stores: list[int] = []
    store = actions._HANDLERS[Op.KV_STORE]

    def storing(s, n) -> None:
        copied = (n.layer, n.mb) in s.kv_work
        store(s, n)
        if copied:
            stores.append(n.layer)

    monkeypatch.setattr(KVCache, "allocate", classmethod(allocating))
    monkeypatch.setattr(MoEModel, "attention", attending)
    monkeypatch.setitem(actions._HANDLERS, Op.KV_STORE, storing)
    runtime = Runtime.create(model, "klotski", KLOTSKI, device="cpu")
    try:
        results, _ = generate(model, runtime)
    finally:
        runtime.close()

    gpu, cpu = runtime.devices.gpu, runtime.devices.cpu
    assert runtime.kv_gpu == frozenset({0, 1}) and not runtime.kv_on_gpu
    assert runtime.cache_device == (gpu, gpu, cpu)
    assert len(homes) == 2 and all(device == runtime.cache_device for device, _ in homes)
    caches = [cache for _, cache in homes]
    in_place = {(layer, any(t is c.keys[layer] for c in caches)) for layer, t in attended}
    assert in_place == {(0, True), (1, True), (2, False)}  # the CPU-homed layer: its working copy
    assert set(stores) == {2}  # only a CPU-homed layer's new k, v go back
    assert [r.output_ids for r in results] == [r.output_ids for r in eager[0]]

    layer_bytes = sum(t.nbytes for c in caches for t in c.layer(0))
    kv = {(c.device, c.value) for c in runtime.trace.counters if c.name == "kv cache bytes"}
    assert {side for side, _ in kv} == {"gpu", "cpu"} and ("gpu", 2 * layer_bytes) in kv
    weights = {c.value for c in runtime.trace.counters if c.name == "gpu weight bytes"}
    gpu_memory = {c.value for c in runtime.trace.counters if c.name == "gpu memory bytes"}
    assert gpu_memory == {w + 2 * layer_bytes for w in weights}

    two_layers = 2 * 5 * 20 * model.spec.kv_bytes_per_token // model.spec.layers
    assert runtime.check_memory(5, 20, 30).kv_cache == 2 * two_layers  # GPU-homed, and working copies


def test_klotski_with_no_gpu_share_keeps_the_whole_cache_on_the_cpu(model: MoEModel) -> None:
    runtime = Runtime.create(model, "klotski", Policy(kv_gpu_share=0.0, weights_gpu_share=0.0), device="cpu")
    runtime.close()
    assert runtime.kv_gpu == frozenset() and runtime.cache_device == runtime.devices.cpu
    whole = 4 * 16 * model.spec.kv_bytes_per_token
    assert runtime.check_memory(4, 16, 8).kv_cache == 2 * whole // model.spec.layers


def test_cache_homes_follow_the_runtimes_devices(model: MoEModel) -> None:
    """Where a CUDA device is the GPU: the kept layers' home is that device, the others the host."""
    runtime = Runtime.create(model, "klotski", KLOTSKI, device="cpu")
    runtime.close()
    runtime.devices = Devices(torch.device("cuda", 0))
    assert runtime.cache_device == (torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cpu"))


@pytest.mark.parametrize("rows", [2048, 4], ids=["released-rows", "4-rows"])
def test_moe_gen_runs_each_expert_once_over_the_expert_group(
    model: MoEModel, eager, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """Two micro-batches in one expert group: the expert kernel is called once per (step, layer,
    expert) and chunk of `rows` (MoE-Gen's EXPERT_ROWS, here also 4 to cut the prefill's GEMMs), each
    call over one expert's rows of both micro-batches, not once per micro-batch; eager's tokens, and
    the same logits bit for bit on a second run."""
    monkeypatch.setattr(moe_gen, "EXPERT_ROWS", rows)
    calls: list[list[int]] = []
    scaled = MoEModel.scaled_experts

    def counting(self, gathered, scales, counts, ffns):
        calls.append(list(counts))
        return scaled(self, gathered, scales, counts, ffns)

    monkeypatch.setattr(MoEModel, "scaled_experts", counting)
    runs = []
    for _ in range(2):
        calls.clear()
        runtime = Runtime.create(model, "moe-gen", MOE_GEN, device="cpu")
        runtime.routing = RoutingTrace()
        try:
            runs.append(generate(model, runtime))
        finally:
            runtime.close()

    group: dict[tuple[int, int, int], int] = {}  # (step, layer, expert) -> the group's tokens
    for (step, layer, _), counts in runtime.routing.counts.items():
        for expert, tokens in counts.counts:
            group[(step, layer, expert)] = group.get((step, layer, expert), 0) + tokens
    chunks = sorted(min(rows, total - start) for total in group.values() for start in range(0, total, rows))
    ffns = [s for s in runtime.trace.spans if s.node.op is Op.EXPERT_FFN]
    assert all(len(c) == 1 for c in calls)  # one expert per call
    assert sorted(c[0] for c in calls) == chunks
    assert len(calls) == sum(math.ceil(total / rows) for total in group.values())
    if rows == 2048:
        assert len(calls) < len(ffns)  # fewer GEMMs than micro-batch nodes
    (results, logits), (_, again) = runs
    assert [r.output_ids for r in results] == [r.output_ids for r in eager[0]]
    assert all(torch.equal(a, b) for step, other in zip(logits, again, strict=True)
               for a, b in zip(step, other, strict=True))  # fmt: skip


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_moe_gen_memory_check_counts_its_kv_buffers(model: MoEModel, where: str) -> None:
    """MoE-Gen's cache lives on the CPU and at most KV_BUFFERS micro-batches' slices of one layer are on
    the GPU at once (the plan's loads wait for the stores three back): 8 sequences in micro-batches of
    3 count three slices of 3 sequences, not two layers of all 8; with CPU attention, none."""
    policy = Policy(micro_batch_size=3, micro_batches=3, weights_gpu_share=0.0, attention_on=where)
    runtime = Runtime.create(model, "moe-gen", policy, device="cpu")
    runtime.close()
    slices = moe_gen.KV_BUFFERS * 3 * 16 * model.spec.kv_bytes_per_token // model.spec.layers
    expected = slices if where == "gpu" else 0  # three slices of one layer of 3 sequences of 16 tokens
    assert runtime.check_memory(8, 16, 8).kv_cache == expected
    assert expected < 2 * 8 * 16 * model.spec.kv_bytes_per_token // model.spec.layers
