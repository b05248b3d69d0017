"""KTransformers' Expert Deferral (`--defer-experts K`): the runtime equals the eager model with the same
deferral, it changes the outputs (measured, not hidden), its simulated trace overlaps a layer's deferred
CPU experts with the next layer's GPU attention, and a bad K is one line."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from attrs import evolve

import flowmoe.devices.cuda as cuda_worker
from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest
from flowmoe.core.policy import Policy
from flowmoe.core.presets import preset
from flowmoe.core.routing_trace import RoutingTrace, replay
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, SchedulerContext, StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel, SyntheticRouting, _ranks
from flowmoe.core.workloads import workload
from flowmoe.devices.factory import make_workers
from flowmoe.jobs.engine import StepInput
from flowmoe.kernels.router import group_by_expert
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import Deferral, MoEModel, expert_ranks
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.ktransformers import KTransformersOptions, deferring_layers
from flowmoe.schedulers.registry import create
from flowmoe.study.simulate import Setup, Simulation, batch_steps
from flowmoe.traces.trace import Trace
from tests.helpers import rel_err
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import TINY_CONFIG, generate, run_scheduler
from tests.test_fake_cuda import FakeCuda

# every family with top-k >= 2 (Llama 4 routes each token to one expert: nothing to defer)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "phimoe", "granitemoe", "ernie4_5_moe"]  # fmt: skip
DEFER_ONE = KTransformersOptions(defer_experts=1)
POLICY = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0, options=(DEFER_ONE,))


def eager_with(deferral: Deferral):
    async def step(model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [model.forward(i.ids, i.cache, i.layout, deferral=deferral) for i in inputs]

    return step


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    folder = save_hf(hf_model(request.param), tmp_path_factory.mktemp("deferral") / request.param)
    return load_model(folder)


def test_runtime_equals_eager_with_the_same_deferral_and_reports_its_deviation(model: MoEModel) -> None:
    (results, logits), runtime = run_scheduler(model, "ktransformers", POLICY)
    deferring = runtime.scheduler.deferring  # type: ignore[attr-defined]
    assert deferring == deferring_layers(model.spec)
    same, same_logits = generate(model, eager_with(Deferral(1, deferring)))
    _, exact_logits = generate(model, eager_with(Deferral(0, frozenset())))
    assert [r.output_ids for r in results] == [r.output_ids for r in same]
    rounding = deviation = 0.0
    for ours, ref, plain in zip(logits, same_logits, exact_logits, strict=True):
        for a, b, c in zip(ours, ref, plain, strict=True):
            assert rel_err(a, b) <= 1e-5
            rounding = max(rounding, rel_err(a, b))  # 0 on the CPU; CUDA's GEMMs round otherwise
            deviation = max(deviation, rel_err(a, c))
    # the deviation from the exact model is there (well above the device's rounding) whenever a layer
    # defers into the next one
    assert (deviation > 10 * rounding) == bool(deferring), (deviation, rounding)


def test_deferral_changes_no_layer_that_cannot_defer() -> None:
    spec = ModelSpec.from_hf({**TINY_CONFIG, "num_hidden_layers": 4})
    assert deferring_layers(spec) == {0, 1, 2}  # the last layer never defers
    assert deferring_layers(spec, frozenset({0, 1})) == {2}  # nor does one whose experts are on the GPU
    qwen = ModelSpec.from_hf({**TINY_CONFIG, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
                              "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
                              "num_hidden_layers": 4, "mlp_only_layers": [2]})  # fmt: skip
    assert deferring_layers(qwen) == {0}  # layer 1's next layer is dense


def test_ranks_follow_the_routing_weights_and_choose_what_kt_kernel_defers() -> None:
    # token 0 weighs expert 3 over 1; token 1 weighs 1 over 2: keeping one expert per token keeps 3 and 1
    indices = torch.tensor([[1, 3], [2, 1]])
    weights = torch.tensor([[0.3, 0.7], [0.4, 0.6]])
    routing = group_by_expert(indices, weights, 4)
    assert expert_ranks(routing) == {1: 0, 2: 1, 3: 0}
    answer = ExpertCounts(0, 0, tuple(routing.counts().items()), ranks=tuple(expert_ranks(routing).items()))
    assert answer.deferrable(1) == (2,) and answer.deferrable(2) == ()
    # a synthetic routing ranks a token's experts in the order it drew them
    assert _ranks([[5, 0], [0, 7], [6, 5]]) == ((0, 0), (5, 0), (6, 0), (7, 1))
    spec = ModelSpec.from_hf(TINY_CONFIG)
    for answer in (
        SyntheticRouting(spec, RoutingModel(seed=1)).trace(batch_steps([4, 4], 2, 2)).counts.values()
    ):
        assert [e for e, _ in answer.ranks] == list(answer.experts)
        assert min(r for _, r in answer.ranks) == 0 and max(r for _, r in answer.ranks) < spec.moe.top_k


def test_the_plan_defers_what_the_routing_ranks_last_and_names_the_next_combine_as_its_own() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)  # 2 layers, 4 experts, top-2
    scheduler = create("ktransformers", SchedulerContext(spec, POLICY, NodeFactory(spec)))
    mb = MicroBatchShape.from_lengths(0, [1, 1], [4, 4])
    ranks = {0: ((0, 0), (1, 1), (2, 0), (3, 1)), 1: ((0, 1), (1, 0), (3, 0))}
    asked: list[RoutingRequest] = []

    def answer(request: RoutingRequest) -> ExpertCounts:
        asked.append(request)
        return ExpertCounts(
            request.layer, 0, tuple((e, 1) for e, _ in ranks[request.layer]), ranks=ranks[request.layer]
        )

    nodes = list(replay(scheduler.plan(StepShape(1, False, (mb,))), answer))
    assert [r.defer for r in asked] == [1, 0]  # layer 1 is the last: it defers nothing
    cpu = [(n.layer, n.expert) for n in nodes if n.lane is Lane.CPU_COMPUTE]
    assert cpu == [(0, 0), (0, 2), (0, 1), (0, 3), (1, 0), (1, 1), (1, 3)]  # kept first, then deferred
    loads = [n for n in nodes if n.op is Op.EXPERT_LOAD]
    combines = {n.layer: n for n in nodes if n.op is Op.COMBINE}
    by_id = {n.id: n for n in nodes}
    deferred_load = loads[1]
    assert {by_id[d].expert for d in deferred_load.deps} == {1, 3}
    assert deferred_load.id not in combines[0].deps and deferred_load.id in combines[1].deps
    # the plan names the combine that adds each expert output: the deferred ones' is the next layer's
    into = {(n.layer, n.expert): n.combine_layer for n in nodes if n.op is Op.EXPERT_FFN}
    assert into == {(0, 0): 0, (0, 2): 0, (0, 1): 1, (0, 3): 1, (1, 0): 1, (1, 1): 1, (1, 3): 1}
    assert [load.combined_at for load in loads] == [-1, 1, -1]
    # a trace without ranks cannot say which experts to defer: one line
    with pytest.raises(ConfigError, match="no expert ranks"):
        list(
            replay(scheduler.plan(StepShape(1, False, (mb,))), lambda r: ExpertCounts(r.layer, 0, ((0, 2),)))
        )


def overlaps(trace, layer: int) -> int:
    """CPU expert FFNs of `layer` running while the GPU runs the next layer's attention (same mb)."""
    spans = trace.spans
    cpu = [
        s
        for s in spans
        if s.node.op is Op.EXPERT_FFN and s.node.lane is Lane.CPU_COMPUTE and s.node.layer == layer
    ]
    attention = [s for s in spans if s.node.op is Op.GPU_ATTN and s.node.layer == layer + 1]
    return sum(
        1 for c in cpu for a in attention if c.node.mb == a.node.mb and c.start < a.end and a.start < c.end
    )


@pytest.mark.parametrize("model_name", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_simulated_trace_overlaps_deferred_cpu_experts_with_the_next_attention(model_name: str) -> None:
    spec = preset(model_name, layers=4)
    policy = Policy(micro_batch_size=1, micro_batches=1, weights_gpu_share=0.0)
    setup = Setup(
        spec, hardware("l4"), workload("fixed:32:3"), policy, RoutingModel(seed=1), decode_samples=2
    )
    exact = Simulation(setup).run("ktransformers")
    deferred = Simulation(evolve(setup, policy=policy.with_options(DEFER_ONE))).run("ktransformers")
    assert exact.error is None and deferred.error is None
    layers = sorted(deferring_layers(spec))
    assert layers and all(overlaps(exact.trace, layer) == 0 for layer in layers)
    assert all(overlaps(deferred.trace, layer) > 0 for layer in layers)
    assert deferred.decode_seconds < exact.decode_seconds  # the CPU works while the GPU attends


def test_a_recorded_trace_keeps_the_ranks(tmp_path) -> None:
    trace = RoutingTrace()
    trace.record(0, ExpertCounts(1, 0, ((2, 3), (5, 1)), ranks=((2, 0), (5, 1))))
    trace.save(tmp_path / "t.jsonl")
    loaded = RoutingTrace.load(tmp_path / "t.jsonl")
    assert loaded.answer(0, RoutingRequest(1, 0, 0, defer=1)).ranks == ((2, 0), (5, 1))


def test_bad_k_is_refused() -> None:
    spec = ModelSpec.from_hf(TINY_CONFIG)
    with pytest.raises(ConfigError, match="--defer-experts"):
        KTransformersOptions(defer_experts=-1)
    two = POLICY.with_options(KTransformersOptions(defer_experts=2))
    with pytest.raises(ConfigError, match="below the model's top-k"):
        create("ktransformers", SchedulerContext(spec, two, NodeFactory(spec)))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--scheduler", "eager", "--defer-experts", "1"], "--defer-experts is an option of ktransformers;"),
        (["--scheduler", "ktransformers", "--defer-experts", "2"], "below the model's top-k"),
        (["--scheduler", "ktransformers", "--defer-experts", "-1"], "--defer-experts"),
    ],
)
def test_bad_k_on_the_command_line_is_one_line_exit_2(
    argv: list[str], says: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["simulate", "--model", "mixtral-8x7b", "--layers", "2", "--hardware", "l4", "--batch-size",
              "1", "--workload", "fixed:8:2", "--micro-batches", "1", "--weights-gpu-share", "0"]  # fmt: skip
    assert main([*common, "--scheduler", "ktransformers", "--defer-experts", "1"]) == 0
    capsys.readouterr()
    assert main([*common, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "\n".join(err)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> MoEModel:
    return load_model(save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("deferral-cuda") / "mixtral"))


def test_the_cuda_host_path_defers_the_same(mixtral: MoEModel) -> None:
    """On the fake CUDA (stream worker, events, the routing left on the device until its ranks are
    asked for): the same tokens as the eager model with the same deferral."""
    fake = FakeCuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_worker, "cuda", fake)
        workers, events = make_workers(torch.device("cuda"))
        devices = Devices(torch.device("cpu"))
        plugin = create("ktransformers", SchedulerContext(mixtral.spec, POLICY, NodeFactory(mixtral.spec)))
        weights = DeviceWeights(mixtral, devices)
        weights.setup(plugin.residency(), plugin.weight_buffer_bytes())
        runtime = Runtime(mixtral, plugin, devices, weights, workers, events, Trace(name="ktransformers"))
        try:
            results, _ = generate(mixtral, runtime)
        finally:
            runtime.close()
    reference, _ = generate(mixtral, eager_with(Deferral(1, plugin.deferring)))
    assert plugin.deferring and [r.output_ids for r in results] == [r.output_ids for r in reference]
