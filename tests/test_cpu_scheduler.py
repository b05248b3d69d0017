"""The `cpu` schedule: one LAYER node per decoder layer on cpu.compute, priced by its parts, nothing on
the GPU, its routing recorded as a gate's (its tokens and logits against eager's: test_scheduler_contract)."""

from __future__ import annotations

import itertools
import json

import pytest

from flowmoe.cli import main
from flowmoe.core.memory import gpu_memory
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import BatchShape, MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import create
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import TINY_CONFIG, generate

SPEC = ModelSpec.from_hf(TINY_CONFIG)  # 2 layers of 4 experts, top-2


def _parts(factory: NodeFactory, mb: MicroBatchShape, experts: int) -> tuple[int, int]:
    """(bytes, flops) of layer 0's parts as eager's nodes, its routed rows through `experts` experts."""
    nodes = [factory.node(op, Lane.CPU_COMPUTE, 0, mb) for op in (Op.PRE_ATTN, Op.CPU_ATTN, Op.POST_ATTN)]
    nodes += [factory.node(op, Lane.CPU_COMPUTE, 0, mb) for op in (Op.GATE, Op.COMBINE)]
    rows = mb.tokens * SPEC.moe.top_k  # every (token, slot) through one expert's weights, once each
    ffn = factory.node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, 0, mb, expert=0, tokens=rows)
    weights = factory.node(Op.EXPERT_FFN, Lane.CPU_COMPUTE, 0, mb, expert=0, tokens=0).bytes
    n_bytes = sum(n.bytes for n in nodes) + ffn.bytes - weights + round(experts * weights)
    return n_bytes, sum(n.flops for n in nodes) + ffn.flops


def test_a_layer_is_priced_by_its_parts() -> None:
    """One token reads its top_k experts' weights; T tokens the E (1 - (1 - k / E)^T) they are
    expected to pick; the flops are every (token, slot)'s."""
    factory = NodeFactory(SPEC)
    one = MicroBatchShape.from_lengths(0, [1], [7])
    layer = factory.node(Op.LAYER, Lane.CPU_COMPUTE, 0, one)
    assert (layer.bytes, layer.flops) == _parts(factory, one, SPEC.moe.top_k)
    prompt = MicroBatchShape.from_lengths(1, [5, 3], [0, 0])
    layer = factory.node(Op.LAYER, Lane.CPU_COMPUTE, 0, prompt)
    expected = 4 * (1 - (1 - 2 / 4) ** 8)  # 3.98 of the 4 experts
    assert (layer.bytes, layer.flops) == _parts(factory, prompt, expected)
    assert layer.rows == 8


def test_the_gpu_holds_nothing() -> None:
    scheduler = create("cpu", SchedulerContext(SPEC, Policy(), NodeFactory(SPEC)))
    batch = BatchShape.of([40, 30], 2, 16)
    assert gpu_memory(scheduler, batch).total == 0
    assert not scheduler.kv_gpu_layers() and not scheduler.residency().dense


def test_its_plan_is_a_node_per_layer() -> None:
    scheduler = create("cpu", SchedulerContext(SPEC, Policy(), NodeFactory(SPEC)))
    step = StepShape(1, False, (MicroBatchShape.from_lengths(0, [1, 1], [4, 6]),))
    nodes = list(scheduler.plan(step))
    assert [n.op for n in nodes] == [Op.EMBED, Op.LAYER, Op.LAYER, Op.LM_HEAD]
    assert {n.lane for n in nodes} == {Lane.CPU_COMPUTE}
    assert all(b.deps == (a.id,) for a, b in itertools.pairwise(nodes))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("cpu") / "mixtral"))


def _ran(model, name: str, new_tokens: int) -> Runtime:
    """A closed runtime of `name` after the built-in prompts, two micro-batches, its routing recorded."""
    runtime = Runtime.create(model, name, Policy(micro_batch_size=3, micro_batches=2), "cpu")
    runtime.routing = RoutingTrace.for_model(model.spec)
    with runtime:
        generate(model, runtime, new_tokens=new_tokens)
    return runtime


def test_its_routing_is_recorded_as_eagers(model) -> None:
    """`flowmoe run --record-routing` with the cpu schedule: each layer's gate, step by step, as eager's
    routing requests record them."""
    ours, eager = (_ran(model, name, 6).routing for name in ("cpu", "eager"))
    assert ours is not None and eager is not None
    assert ours.counts and ours.counts == eager.counts


def test_its_trace_has_a_span_per_layer(model) -> None:
    runtime = _ran(model, "cpu", 2)
    layers = [s for s in runtime.trace.spans if s.node.op is Op.LAYER]
    steps = len(runtime.trace.steps)
    assert len(layers) == steps * 2 * model.spec.layers  # every step, micro-batch and layer
    assert {s.node.lane for s in runtime.trace.spans} == {Lane.CPU_COMPUTE}


def test_the_simulator_shows_it_all_on_the_cpu(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flowmoe simulate --scheduler cpu`: its row and policy line say attention and experts ran on the
    CPU and the GPU held no expert and no cache, whatever the policy's own placements say."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    argv = ["simulate", "--model", str(tmp_path), "--workload", "fixed:6:4", "--scheduler", "cpu",
            "--batch-size", "2", "--attention-on", "gpu"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    cells = next(line for line in text.splitlines() if line.startswith("cpu") and "x" in line).split()
    assert cells[6:8] == ["cpu", "cpu*"] and cells[8].startswith("0.0") and cells[9].startswith("0%")
    assert "cpu: N=2 (2x1) attn cpu ffn cpu w 0% kv 0%" in " ".join(text.split())
