"""Page copies: a run of pages the plan emits back to back is one PAGE_COPY node (core/page_runs.py)
and only where nothing else of the plan comes between them; a node's pages are one copy operation
(runtime/paged_copy.py) that lands the same bytes as copying the pages one by one."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from flowmoe.core.page_runs import page_runs
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import replay
from flowmoe.core.scheduling import NodeFactory, PlanStream, Residency
from flowmoe.model.arena import ALIGN
from flowmoe.model.fp8 import FP8Weight
from flowmoe.model.loading import load_model
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.weights import FFNWeights
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.paged_copy import HostSpan, copy_run, land
from flowmoe.runtime.pinned import pin_layers
from flowmoe.schedulers.cgopipe import _Plan
from flowmoe.study.simulate import simulate
from tests.hf_models import hf_model, save_hf
from tests.test_sched_pipelines import MIXTRAL, T4, decode_step, scheduler, uniform_trace

F = NodeFactory(MIXTRAL)


def _merged(items: list[TaskNode | RoutingRequest]) -> list[TaskNode | RoutingRequest]:
    """What `page_runs` makes of a plan that emits `items` (each routing request answered)."""

    def plan() -> PlanStream:
        for item in items:
            reply = yield item
            assert (reply is not None) == isinstance(item, RoutingRequest)

    out, stream, reply = [], page_runs(plan()), None
    while True:
        try:
            item = stream.send(reply)
        except StopIteration:
            return out
        out.append(item)
        reply = ExpertCounts(item.layer, item.mb, ()) if isinstance(item, RoutingRequest) else None


def _page(part: int, expert: int = 3, deps: tuple[int | None, ...] = (), parts: int = 6) -> TaskNode:
    return F.node(Op.PAGE_COPY, Lane.GPU_H2D, 1, expert=expert, deps=deps, part=part, parts=parts)


def test_consecutive_pages_of_one_expert_are_one_node() -> None:
    """Pages 0..5 of an expert, each after the one before (as lru-cache chains them), the first after an
    eviction: one node with the last page's id, the first's deps and all six pages' bytes; a later node
    that waited for a middle page waits for the run."""
    evict = F.node(Op.EVICT, Lane.GPU_COMPUTE, 1, expert=3)
    pages = [_page(0, deps=(evict.id,))]
    for part in range(1, 6):
        pages.append(_page(part, deps=(evict.id, pages[-1].id)))
    ffn = F.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 1, expert=3, deps=[pages[2].id, pages[5].id])
    out = _merged([evict, *pages, ffn])
    assert [n.op for n in out] == [Op.EVICT, Op.PAGE_COPY, Op.EXPERT_FFN]
    run = out[1]
    assert isinstance(run, TaskNode)
    assert (run.id, run.deps, run.part, run.pages, run.parts) == (pages[-1].id, (evict.id,), 0, 6, 6)
    assert run.bytes == MIXTRAL.expert_bytes == sum(p.bytes for p in pages)
    assert out[2] == evolve(ffn, deps=(pages[-1].id,))
    assert run.label == "page_copy L1 e3 p0-5/6"


def test_pages_with_anything_between_them_stay_apart() -> None:
    """A hidden load between two pages on the link, a routing request, another expert's page, a page
    that waits for something of its own (its staging copy) or a page out of order: no merge there."""
    load = F.node(Op.HIDDEN_LOAD, Lane.GPU_H2D, 1)
    stage = F.node(Op.W_STAGE, Lane.CPU_STAGE, 1, expert=3, part=4, parts=6)
    gate = F.node(Op.GATE, Lane.GPU_COMPUTE, 1)
    plan: list[TaskNode | RoutingRequest] = [
        gate, stage, _page(0), load, _page(1), RoutingRequest(1, 0, gate.id), _page(2), _page(0, expert=4),
        _page(3), _page(4, deps=(stage.id,)), _page(1),
    ]  # fmt: skip
    out = _merged(plan)
    assert out == plan and sum(isinstance(n, TaskNode) and n.op is Op.PAGE_COPY for n in out) == 7
    merged = _merged([_page(4), _page(5), _page(0, expert=4), _page(1, expert=4)])
    assert [(n.expert, n.part, n.pages) for n in merged if isinstance(n, TaskNode)] == [(3, 4, 2), (4, 0, 2)]


@pytest.mark.parametrize("pinned", [True, False])
def test_cgopipe_merges_its_pinned_pages_and_keeps_the_staged_ones(pinned: bool) -> None:
    """cgopipe's chunks of pages follow each hidden load: pinned, each chunk's pages of one expert are
    one node; staged through pinned buffers (MoE-Lightning's system, as `flowmoe reproduce` runs it),
    each page waits for its own staging copy and stays a node of its own. Either way the link carries
    the same bytes."""
    policy = Policy(micro_batch_size=256, micro_batches=4, attention_on="cpu", weights_gpu_share=0.75)
    step = decode_step(4, 256, 512)
    plugin = scheduler("cgopipe", MIXTRAL, policy, weights_pinned=pinned)
    spans = simulate(plugin, [step], uniform_trace(MIXTRAL, [step]), T4)
    copies = [s.node for s in spans if s.node.op is Op.PAGE_COPY]
    pages = sum(n.pages for n in copies)
    assert sum(n.bytes for n in copies) * 21 == pages * MIXTRAL.expert_bytes  # 21 pages per expert
    assert (len(copies) < pages) == pinned and all(n.pages == 1 for n in copies) != pinned


def test_cgopipe_emits_its_pinned_runs_as_page_runs_would_merge_them() -> None:
    """Pinned, cgopipe emits each chunk's pages of one expert as one node already (built once per run,
    not per page): `page_runs` has nothing left to merge, and each run carries the bytes of its pages
    one by one (NodeFactory.node's `pages`)."""
    policy = Policy(micro_batch_size=256, micro_batches=4, attention_on="cpu", weights_gpu_share=0.75)
    step = decode_step(4, 256, 512)
    trace = uniform_trace(MIXTRAL, [step])
    plan: list[TaskNode | RoutingRequest] = [
        *replay(scheduler("cgopipe", MIXTRAL, policy).plan(step), lambda r: trace.answer(0, r))
    ]
    copies = [n for n in plan if isinstance(n, TaskNode) and n.op is Op.PAGE_COPY]
    assert any(n.pages > 1 for n in copies)
    assert [n for n in _merged(plan) if isinstance(n, TaskNode) and n.op is Op.PAGE_COPY] == copies
    for n in copies:
        one_by_one = [F.node(Op.PAGE_COPY, n.lane, n.layer, expert=n.expert, part=p, parts=n.parts) for p in
                      range(n.part, n.part + n.pages)]  # fmt: skip
        assert n.bytes == sum(page.bytes for page in one_by_one)


@given(st.integers(0, 6), st.integers(1, 9), st.integers(1, 9))
def test_cgopipe_works_out_its_runs_from_the_chunk_bounds_as_its_pages_list_them(
    experts: int, parts: int, chunks: int
) -> None:
    """The runs cgopipe emits pinned (worked out from each chunk's bounds, no page listed) are its
    listed pages of each chunk grouped by expert, part after part."""
    policy = Policy(micro_batch_size=4, micro_batches=chunks, weights_gpu_share=0.0)
    plugin = scheduler("cgopipe", MIXTRAL, policy)
    plugin.paged, plugin.parts, plugin.per_page = {0: list(range(3, 3 + experts))}, parts, 1
    plan = _Plan(plugin, decode_step(chunks, 4, 8))
    for chunk in range(chunks):
        grouped: list[tuple[tuple[int, ...], int, int]] = []
        for group, part in plan._chunk_pages(0, chunk, chunks):
            last = grouped[-1] if grouped else None
            if last is not None and last[0] == group and last[1] + last[2] == part:
                grouped[-1] = (group, last[1], last[2] + 1)
            else:
                grouped.append((group, part, 1))
        assert plan._runs(0, chunk, chunks) == grouped


def _packed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` copied into one host buffer, each at an ALIGN boundary (as model/arena.py packs them)."""
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    arena, views, offset = torch.zeros(sum(sizes), dtype=torch.uint8), [], 0
    for tensor, size in zip(tensors, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        views.append(arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
        views[-1].copy_(tensor)
        offset += size
    return views


def _experts() -> list[FFNWeights | QuantizedExpert]:
    g = torch.Generator().manual_seed(0)
    gate_up, down, bias = (torch.randn(s, generator=g).bfloat16() for s in ((22, 16), (16, 11), (22,)))
    native = FFNWeights(*_packed([gate_up, down, bias]))
    fp8 = [torch.randn(s, generator=g).to(torch.float8_e4m3fn) for s in ((11, 16), (11, 16), (16, 11))]
    tensors = _packed([t for v in fp8 for t in (v, torch.rand(1, 1, generator=g) + 0.5)])
    gate, up, down = (FP8Weight(tensors[i], tensors[i + 1], (128, 128)) for i in (0, 2, 4))
    return [native, QuantizedExpert((gate, up), down, torch.bfloat16)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("runs", [[1] * 7, [3, 1, 3], [7], [2, 5]])
@pytest.mark.parametrize("which", [0, 1], ids=["native", "fp8"])
def test_a_run_of_pages_lands_the_bytes_the_pages_do_one_by_one(which: int, runs: list[int]) -> None:
    """An expert cut in 7 pages copied in runs of `runs` pages: every tensor lands with the host's
    bytes, in a buffer of its own, as with one page at a time."""
    weights = _experts()[which]
    span = HostSpan.of(weights.tensors())
    flat, landed = land(weights, span, torch.device("cpu", 0))
    part = 0
    for pages in runs:
        copy_run(span, flat, part, 7, pages)
        part += pages
    for host, device in zip(weights.tensors(), landed.tensors(), strict=True):
        assert torch.equal(_bytes(device), _bytes(host)) and device.data_ptr() != host.data_ptr()
        assert (device.shape, device.dtype) == (host.shape, host.dtype)
        assert device.untyped_storage().data_ptr() == flat.data_ptr()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops["view" if func.is_view else str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_a_copy_node_dispatches_one_copy_and_at_most_a_view() -> None:
    """After its host bytes were viewed once, a node's pages cost one `copy_` (and the slice of the
    device buffer it lands in, unless it is the whole expert): never one operation per page or tensor."""
    weights = _experts()[0]
    span = HostSpan.of(weights.tensors())
    flat, _ = land(weights, span, torch.device("meta"))
    for part, pages in ((0, 1), (1, 3), (4, 3), (0, 7)):
        copy_run(span, flat, part, 7, pages)  # the host side's views, made once
        with _Ops() as counter:
            copy_run(span, flat, part, 7, pages)
        assert counter.ops == Counter({"aten.copy_.default": 1, **({} if pages == 7 else {"view": 1})})


def test_device_weights_take_a_paged_expert_in_runs(tmp_path) -> None:
    """DeviceWeights on a "GPU" that is another device (here cpu:0, so the bytes can be compared):
    pages in runs make the expert resident after the last, with the host's values in one buffer of the
    device's, and its pages one copy each."""
    model = load_model(save_hf(hf_model("mixtral"), tmp_path / "mixtral"))
    pin_layers(model, register=lambda arena: None)  # packed as the runtime packs them on CUDA
    weights = DeviceWeights(model, Devices(torch.device("cpu", 0)))
    weights.setup(Residency.dense_only(model.spec), model.spec.expert_bytes)
    weights.load(0, 1, 0, 5, 2)
    weights.load(0, 1, 2, 5, 3)
    host, device = model.weights.layers[0].experts[1], weights.expert(0, 1)
    for a, b in zip(host.tensors(), device.tensors(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert device.down.untyped_storage().data_ptr() == device.gate_up.untyped_storage().data_ptr()
