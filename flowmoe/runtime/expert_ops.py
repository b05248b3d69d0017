"""What a layer's expert nodes do: their input to the host, the expert GEMMs, their outputs back, and
the COMBINE that adds them into the residual stream, each as its plan says.

An EXPERT_FFN serves its own micro-batch, or the micro-batches its node names (`TaskNode.serves`,
MoE-Gen's expert batch: one GEMM over all their tokens, at the first one's node); its output goes to
the combine its node names (`TaskNode.combined_at`, Expert Deferral's next layer), else its own
layer's.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.executor import Action
from flowmoe.core.plan import Op, TaskNode
from flowmoe.kernels.no_copy import on
from flowmoe.runtime.activations import Key

if TYPE_CHECKING:
    from flowmoe.runtime.actions import StepState


def bind_expert(s: StepState, n: TaskNode) -> Action:
    """An EXPERT_FFN's action: its own micro-batch's tokens, with the other experts of its group at
    hand (`_expert`); or, where it names the micro-batches it serves, the one GEMM the plan prices over
    all their tokens at the first one's node (`_expert_batch`) and nothing at the others' (they wait
    for it; their outputs are there)."""
    if n.serves and n.mb not in n.serves:
        raise FlowmoeError(f"{n.label}: serves micro-batches {list(n.serves)}, not its own")
    s.outputs.plan(n)
    if not n.serves:
        s.groups.bind(n)
        return partial(_expert, s, n)
    return partial(_expert_batch, s, n) if n.mb == n.serves[0] else None


def _expert(s: StepState, n: TaskNode) -> None:
    """The node's expert, and with it in one kernel call (MoEModel.routed_experts) the other experts of
    its group bound to the same lane whose weights are at hand (LaneWeights.taken: the host's own on
    the CPU lane, those resident without CUDA, on CUDA those in the device's slot pool whose copies
    the node's stream can wait for without the host). Their own nodes then find their outputs done;
    the rest run at their nodes."""
    ffns = s.groups.take(n, partial(s.weights.taken, n))
    if not ffns:
        return  # ran in the group of an earlier node
    key = (n.layer, n.mb)
    x = s.acts.expert_input(key, n.lane)
    s.outputs.keep(key, s.model.routed_experts(x, s.routings.decided(key), ffns))


def _expert_batch(s: StepState, n: TaskNode) -> None:
    """One GEMM of the node's expert over its tokens in every micro-batch it serves (MoE-Gen's
    module-based batching): the rows gathered in micro-batch order, in kernel calls of the node's rows
    each (the GEMM the plan prices, chunked as it is), the outputs split back per micro-batch. A fixed
    order: the same floats every run."""
    ffn = s.weights.ffn(n, n.expert)
    routings = {key: s.routings.decided(key) for key in [(n.layer, mb) for mb in n.serves]}
    routed = {key: r for key, r in routings.items() if n.expert in r.sizes}  # those routed to it, in order
    inputs = [s.acts.expert_input(key, n.lane) for key in routed]  # [T_mb, hidden] each
    gathered = torch.cat(
        [x[on(r.tokens[n.expert], x.device)] for x, r in zip(inputs, routed.values(), strict=True)]
    )
    scales = on(torch.cat([r.scales[n.expert] for r in routed.values()]), gathered.device)[:, None]  # [N, 1]
    rows = n.rows or len(gathered)  # [N, hidden] in chunks of `rows`
    outs = [s.model.scaled_experts(chunk, weight, [len(chunk)], [ffn])[0]
            for chunk, weight in zip(gathered.split(rows), scales.split(rows), strict=True)]  # fmt: skip
    counts = [r.sizes[n.expert] for r in routed.values()]
    for key, out in zip(routed, torch.cat(outs).split(counts), strict=True):
        s.outputs.keep(key, {n.expert: out})


def _hidden_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.acts.x_cpu[key] = s.devices.to_cpu_lane(s.acts.x[key])  # read by the CPU's experts


def _expert_load(s: StepState, n: TaskNode) -> None:
    """CPU experts' outputs to the GPU: those the node's combine adds (its experts, else all so far)."""
    s.outputs.move(n, s.devices.gpu)


def _shared(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.acts.shared[key] = s.model.shared(n.layer, s.acts.x[key], s.weights.device.layer(n.layer))


def _combine(s: StepState, n: TaskNode) -> None:
    """Residual + the layer's experts the plan combines here + the earlier layers' ones it carries
    here + the shared expert (or dense MLP)."""
    key, acts = (n.layer, n.mb), s.acts
    routing = s.routings.decided(key) if s.routings.gated(key) else None
    later = s.outputs.elsewhere(key)  # Expert Deferral: a later layer's combine adds these
    own = s.outputs.own(key)
    outputs = {e: on(t, s.devices.gpu) for e, t in own.items()}  # a CPU expert's comes from the host
    if routing is not None and set(outputs) != set(routing.experts) - later:
        missing = sorted(set(routing.experts) - later - set(outputs))
        raise FlowmoeError(f"combine of layer {n.layer} mb {n.mb}: experts {missing} never ran")
    previous = acts.hidden[n.mb]
    carry, carried = _carry(s, key, previous)
    acts.hidden[n.mb] = s.model.combine(previous, routing, outputs, acts.shared.get(key), later, carry)
    # What only this layer's attention, experts and combine read dies here, not at the step's end;
    # x stays for the next layer's pre-gate, the previous layer's x goes once its pre-gates ran;
    # experts combined later keep their input until that combine.
    x_cpu = None if later else acts.x_cpu.pop(key, None)
    dead = [*acts.qkv.pop(key, ()), acts.attn.pop(key, None), *own.values(), *outputs.values(), *carried,
            acts.shared.pop(key, None), x_cpu, previous]  # fmt: skip
    acts.retire(dead)
    acts.release_x((n.layer - 1, n.mb), reader=False)


def _carry(
    s: StepState, key: Key, like: torch.Tensor
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The sum [T, hidden] of the earlier layers' expert outputs the plan adds into (layer, mb)'s combine
    (None where it adds none), and the tensors that die with it (their input's host copy too)."""
    total, dead = None, []
    for source, experts, outputs in s.outputs.carried(key):
        moved = {e: on(t, s.devices.gpu) for e, t in outputs.items()}
        part = s.model.routed_sum(like, s.routings.decided(source), moved, experts)
        total = part if total is None else total + part
        dead += [*outputs.values(), *moved.values(), s.acts.x_cpu.pop(source, None)]
    return total, dead


EXPERT_OPS = {
    Op.HIDDEN_OFFLOAD: _hidden_offload,
    Op.EXPERT_LOAD: _expert_load,
    Op.SHARED_FFN: _shared,
    Op.COMBINE: _combine,
}
