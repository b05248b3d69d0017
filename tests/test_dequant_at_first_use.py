"""Packed experts on the GPU (runtime/device_weights.py): the copy lane's stream only copies the packed
bytes; the expert is dequantized at its first use, on the stream of the lane that uses it, once per
arrival, its packed bytes marked as read there (record_stream). Checked on the CPU with a "GPU" that
is another device (cpu:0: the copying path) and the fake CUDA's streams and events: the placement,
the order against the copy's event through the CUDA stream worker, the ledger, and every scheduler
giving eager's tokens on an int4 model."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

import flowmoe.devices.cuda as cuda_worker
import flowmoe.runtime.device_weights as device_weights
import flowmoe.runtime.lane_weights as lane_weights
from flowmoe.core.plan import Lane
from flowmoe.core.policy import Policy
from flowmoe.core.scheduling import Residency
from flowmoe.devices.factory import make_workers
from flowmoe.model.loading import Packing, load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.pinned import pin_layers
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import gpu_schedulers, run_eager, run_through
from tests.test_fake_cuda import FakeCuda
from tests.test_grouped_experts import torch_ops_only  # noqa: F401  # a fixture, used by name

COPYING = Devices(torch.device("cpu", 0))  # not the host's "cpu": weights are copied, as to a GPU


@attrs.frozen
class CopyingCuda(Devices):
    """cpu:0 standing in for a CUDA device: copies as COPYING does, and the CUDA-only bookkeeping
    (record_stream, on the fake CUDA's streams) runs."""

    @property
    def cuda(self) -> bool:
        return True


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("first-use") / "mixtral")


@pytest.fixture(scope="module")
def model(folder: Path) -> MoEModel:
    model = load_model(folder, packing=Packing("int4"))
    pin_layers(model, register=lambda arena: None)  # one host span per expert: its pages' source
    return model


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """The fake CUDA in the stream worker, the lanes and the device's weights; each dequantization
    (its expert's key) and each record_stream logged with the stream current at the call."""
    fake = FakeCuda()
    for module in (cuda_worker, lane_weights, device_weights):
        monkeypatch.setattr(module, "cuda", fake)
    dequantized = DeviceWeights._dequantized

    def logged(self: DeviceWeights, key: tuple[int, int], packed: QuantizedExpert):
        fake.log.append(("dequantize", key, fake.current_stream()))
        return dequantized(self, key, packed)

    monkeypatch.setattr(DeviceWeights, "_dequantized", logged)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: fake.log.append(("record_stream", t, s)))
    return fake


def _kinds(fake: FakeCuda) -> list[str]:
    return [kind for kind, *_ in fake.log]


def test_the_copy_stream_copies_and_the_first_use_dequantizes_on_its_own_stream_once(
    model: MoEModel, fake: FakeCuda
) -> None:
    weights = DeviceWeights(model, CopyingCuda(torch.device("cpu", 0)), expert_format="int4")
    weights.setup(Residency.dense_only(model.spec), 3 * model.spec.expert_bytes)
    dense = weights.nbytes
    h2d, compute = fake.Stream(), fake.Stream()
    fake.set_stream(h2d)
    fake.log.clear()
    weights.load(0, 1)  # whole
    weights.load(0, 2, 0, 2, 1)  # in two pages
    weights.load(0, 2, 1, 2, 1)
    assert "dequantize" not in _kinds(fake)  # the copy lane copied packed bytes and nothing else
    arrived = weights._experts[(0, 1)]
    assert isinstance(arrived, QuantizedExpert) and isinstance(weights._experts[(0, 2)], QuantizedExpert)
    held = weights.nbytes
    assert held == dense + 2 * model.spec.expert_bytes  # each charged dequantized from its first page on

    fake.set_stream(compute)
    ffn = weights.expert(0, 1)
    (kind, what, stream), *recorded = fake.log
    assert (kind, what, stream) == ("dequantize", (0, 1), compute)
    assert [(k, s) for k, _, s in recorded] == [("record_stream", compute)] * len(arrived.tensors())
    assert all(a is b for (_, a, _), b in zip(recorded, arrived.tensors(), strict=True))
    host = model.weights.layers[0].expert(1)  # the host's own dequantization (torch)
    for ours, theirs in zip(ffn.tensors(), host.tensors(), strict=True):
        assert torch.equal(ours, theirs)
    fake.log.clear()
    assert weights.expert(0, 1) is ffn and not fake.log  # its later uses: no second dequantization
    assert weights.nbytes == held

    weights.expert(0, 2)  # the paged one: its packed tensors are views of its one landing buffer
    assert _kinds(fake) == ["dequantize"] + ["record_stream"] * len(arrived.tensors())
    weights.evict(0, 1)  # on the lane that used it last
    assert weights.nbytes == dense + model.spec.expert_bytes
    fake.set_stream(h2d)
    weights.load(0, 1)
    fake.set_stream(compute)
    fake.log.clear()
    assert weights.expert(0, 1) is not ffn and _kinds(fake)[0] == "dequantize"  # once per arrival
    weights.close()


def _dequantized_after_their_copies(fake: FakeCuda, h2d: object, compute: object) -> int:
    """Every dequantization runs on `compute`, once per arrival of its expert (a load since its last
    one), and, for an expert copied on `h2d`, after `compute` has waited for an event recorded on
    `h2d` at or after the end of that copy's node; returns how many ran."""
    arrived: set[tuple[int, int]] = set()  # loaded (a page of it) since its last dequantization
    copied_at: dict[tuple[int, int], int] = {}  # (layer, expert) -> its last page's end record
    pending: dict[tuple[int, int], bool] = {}  # copied, the end of its node not recorded yet
    recorded_at: dict[int, int] = {}  # id of an h2d event -> position of its latest record
    synced_past = -1  # the latest h2d record position `compute` has waited for
    dequantized = 0
    for position, (kind, what, where) in enumerate(fake.log):
        if kind == "load":
            arrived.add(what)
            pending[what] = where is h2d
        elif kind == "record" and where is h2d:
            recorded_at[id(what)] = position
            for key in [k for k, waiting in pending.items() if waiting]:
                copied_at[key], pending[key] = position, False
        elif kind == "wait" and what is compute and id(where) in recorded_at:
            synced_past = max(synced_past, recorded_at[id(where)])
        elif kind == "dequantize":
            assert where is compute, "an expert dequantized off the compute lane's stream"
            assert what in arrived, f"expert {what} dequantized twice in one arrival"
            arrived.discard(what)
            assert not pending.get(what), f"expert {what} dequantized before its copy's node ended"
            if what in copied_at:
                assert synced_past >= copied_at[what], f"expert {what} dequantized before its copy's event"
            dequantized += 1
    return dequantized


@pytest.mark.usefixtures("torch_ops_only")  # eager's packed experts through torch, as the GPU's
@pytest.mark.parametrize("name", gpu_schedulers())
def test_every_scheduler_gives_eagers_tokens_dequantizing_at_first_use_on_the_compute_stream(
    model: MoEModel, name: str, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CUDA stream worker and its events (the fake; int4 experts copied packed to cpu:0):
    eager's tokens, each dequantization on the compute lane's stream after that stream waited for
    its expert's copy, once per arrival."""
    (reference, _) = run_eager(model)
    load = DeviceWeights.load

    def loading(self: DeviceWeights, layer: int, expert: int, *pages: int) -> None:
        load(self, layer, expert, *pages)
        if expert >= 0:
            fake.log.append(("load", (layer, expert), fake.current_stream()))

    monkeypatch.setattr(DeviceWeights, "load", loading)
    workers, events = make_workers(torch.device("cuda"))
    h2d, compute = (workers[lane].stream(lane) for lane in (Lane.GPU_H2D, Lane.GPU_COMPUTE))
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.5, expert_format="int4")
    (results, _) = run_through(model, name, policy, COPYING, workers, events)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    dequantized = _dequantized_after_their_copies(fake, h2d, compute)
    assert dequantized > 0
