"""What the host dispatches per decode step stays as cut (issue 29 item 3): the torch operations each
compute node's action dispatches, counted as bench/step_counts.py counts them (a TorchDispatchMode
under inference mode, views included, by the node op whose action ran), on a tiny Mixtral with
cgopipe, attention on the GPU lane and on the CPU (MoE-Lightning's S1). The counts depend on the
code path and the plan, not on the machine; a change that adds operations to a node fails here.

And the fused forms dispatched instead give the floats of the forms they replace."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flowmoe.runtime.actions as actions
from flowmoe.core.plan import TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.spec import ModelSpec
from flowmoe.jobs.engine import Engine, StepInput
from flowmoe.kernels import cpu_attention, cpu_expert, native
from flowmoe.kernels.grouped_experts import swiglu_grouped
from flowmoe.kernels.norm import rms_norm
from flowmoe.kernels.rope import Rotary
from flowmoe.model.arena import layer_arena
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import TensorMap
from flowmoe.runtime.runner import Runtime
from tests.schedule_fixtures import REQUESTS, TINY_CONFIG

# ops per node of each compute op, mean over the decode steps (cgopipe, 2 micro-batches of 3, float32:
# the CPU's few-row linear is (w @ x.T).T, 4 operations; the per-micro-batch rope and mask are built
# by each micro-batch's first layer, the rope two rows gathered from the model's table of positions,
# MoEModel.rope: 53 / 3 when it was computed for each step); FFN: a group of
# experts at hand in one grouped GEMM per projection (kernels/grouped_experts.py; the layers packed
# as the loaders pack them), the same operations whatever its size, its weights viewed once per
# layer buffer (441 / 39 expert by expert; here 13 operations a group: 12 groups of 39 experts);
# GATE: a routing's per-expert views of its sorted rows and scales are split where first read
# (kernels/router.py Routing), not by the gate (14); its counts are a zeros + ones + index_add_ (14: not
# one bincount, which on CUDA reads its input back, a stream synchronize)
# LM_HEAD: a decode step's rows are all last rows, so no gather before the head (8)
GPU_ATTENTION = {"PRE_ATTN": 39 / 3, "GPU_ATTN": 40 / 3, "POST_ATTN": 6, "GATE": 14,
                 "EXPERT_FFN": 4, "COMBINE": 4, "LM_HEAD": 7, "EMBED": 1}  # fmt: skip
CPU_ATTENTION = {**{k: v for k, v in GPU_ATTENTION.items() if k != "GPU_ATTN"}, "CPU_ATTN": 40 / 3}
COMPUTE = {*GPU_ATTENTION, *CPU_ATTENTION}


class _Counter(TorchDispatchMode):
    """Every aten operation dispatched while `on`, by the op name of the node running it."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.label = False, ""
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on and self.label:
            self.ops[self.label] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def model() -> MoEModel:
    """Built for each test: the grouped experts' views of a layer's buffer are made at their first
    use (kernels/grouped_experts.py), so a test that ran before would change the counts. They are
    made here, as a prefill's first grouped call makes them where its routing takes the grouped path
    (every expert's rows in linear's transposed form), so that decode steps count their own
    operations whatever the prefill took."""
    spec = ModelSpec.from_hf({**TINY_CONFIG, "num_hidden_layers": 3})
    tensors, source = TensorMap.for_spec(spec), RandomSource(spec, seed=7, std=0.2)
    layers = [tensors.load_layer(layer, source) for layer in range(spec.layers)]
    for weights in layers:  # one host buffer per layer, as the loaders pack it
        layer_arena(weights)
        ffns = [(f.gate_up, f.down, None, None) for f in weights.experts]
        rows = torch.zeros(len(ffns), spec.hidden, dtype=ffns[0][0].dtype)  # a row an expert
        assert swiglu_grouped(rows, [1] * len(ffns), ffns, spec.moe) is not None
    return MoEModel.build(spec, tensors.load_top(source, layers))


def _ops_per_node(model: MoEModel, policy: Policy, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    counter, nodes = _Counter(), Counter[str]()
    bind = actions.StepState.action

    def action(self: actions.StepState, node: TaskNode) -> Any:
        bound = bind(self, node)
        if bound is None:
            return None

        def run() -> Any:
            counter.label = node.op.name
            nodes[node.op.name] += counter.on
            try:
                return bound()
            finally:
                counter.label = ""

        return run

    monkeypatch.setattr(actions.StepState, "action", action)
    with Runtime.create(model, "cgopipe", policy, "cpu") as runtime, counter:

        async def counted(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
            counter.on = all(p > 0 for step in inputs for p in step.layout.past)  # decode steps only
            try:
                return await runtime(m, inputs)
            finally:
                counter.on = False

        async def go() -> None:
            engine = Engine(model, counted, max_new_tokens=3, cache_device=runtime.cache_device)
            mbs = [engine.micro_batch(i, REQUESTS[i * 3 : (i + 1) * 3]) for i in range(2)]
            _ = [r async for r in engine.run_batch(mbs)]

        with torch.inference_mode():
            asyncio.run(go())
    return {op: counter.ops[op] / nodes[op] for op in nodes if op in COMPUTE and nodes[op]}


@pytest.fixture
def torch_ops_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C kernels off (FLOWMOE_CPU_KERNELS=0): torch operations everywhere, as on the GPU. Their
    libraries are looked up once per process, so the lookups are forgotten before and after (an
    earlier test of the suite may have loaded them)."""
    lookups = (native.library, cpu_expert.library, cpu_attention.library)
    monkeypatch.setenv("FLOWMOE_CPU_KERNELS", "0")
    for lookup in lookups:
        lookup.cache_clear()
    yield
    monkeypatch.undo()
    for lookup in lookups:
        lookup.cache_clear()


@pytest.mark.usefixtures("torch_ops_only")
@pytest.mark.parametrize("attention_on", ["gpu", "cpu"])
def test_ops_per_compute_node_stay_cut(
    model: MoEModel, attention_on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = Policy(micro_batch_size=3, micro_batches=2, weights_gpu_share=0.0, attention_on=attention_on)
    expected = GPU_ATTENTION if attention_on == "gpu" else CPU_ATTENTION
    assert _ops_per_node(model, policy, monkeypatch) == pytest.approx(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_gives_the_float32_composite_floats(dtype: torch.dtype) -> None:
    """F.rms_norm without a weight (one operation) = Hugging Face's float32 RMSNorm, bit for bit."""
    x = torch.randn(7, 5, 96, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    weight = torch.randn(96).to(dtype)
    x32 = x.to(torch.float32)
    reference = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-6), reference)


@pytest.mark.parametrize(
    ("dtype", "rotated"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 8)]
)
def test_rotary_gives_rotate_half_floats(dtype: torch.dtype, rotated: int) -> None:
    """One roll against a sign-folded sin = rotate-half's cat((-x2, x1)) * sin, bit for bit (a partial
    rope rotates the first dims only)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 16, generator=generator).to(dtype)  # [T, heads, D]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotated, 2, dtype=torch.float32) / rotated)
    positions = torch.tensor([0, 3, 9, 17, 40])
    freqs = positions[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, R]
    part, rest = x[..., :rotated], x[..., rotated:]
    half = rotated // 2
    reference = part * cos + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin
    assert torch.equal(Rotary.at(inv_freq, 1.0, positions, dtype)(x), torch.cat((reference, rest), dim=-1))
