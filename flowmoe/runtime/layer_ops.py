"""What the nodes around a layer's experts do: the embedding, attention and its copies (q, k, v, the
KV cache, the attention output, the residual stream), the gates, weight pages and the LM head.

Where a tensor lives follows the lane: gpu.* lanes compute on the GPU device, cpu.compute on the
CPU; copy nodes move tensors between them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.executor import Action
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.kernels.kv_cache import read_kv, store_kv
from flowmoe.kernels.no_copy import on

if TYPE_CHECKING:
    from flowmoe.runtime.actions import StepState


def _embed(s: StepState, n: TaskNode) -> None:
    """On a GPU lane with the device's embedding; on cpu.compute (a CPU-only schedule) the host's."""
    ids = on(s.inputs[n.mb].ids, s.inputs.place(n.lane), non_blocking=True)
    s.acts.hidden[n.mb] = s.model.embed(ids, s.weights.device.embed if n.lane.on_gpu else None)


def _pre_attn(s: StepState, n: TaskNode) -> None:
    rope, lw = s.inputs.rope(n.mb, n.lane), s.weights.device.layer(n.layer)
    s.acts.qkv[(n.layer, n.mb)] = s.model.pre_attention(n.layer, s.acts.hidden[n.mb], rope, lw)


def _qkv_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.acts.qkv[key] = tuple(s.devices.to_cpu_lane(t) for t in s.acts.qkv[key])  # read by CPU attention


def _attention(s: StepState, n: TaskNode) -> None:
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    q, k, v = s.acts.qkv[key]
    kv = s.acts.kv_work.get(key) or step.cache.layer(n.layer)
    layout = s.inputs.layout(n.mb, n.lane) if kv[0].device == s.inputs.place(n.lane) else step.layout
    lw = s.weights.layer(n.layer, n.lane)
    s.acts.attn[key] = s.model.attention(n.layer, q, k, v, kv, layout, lw)


def _kv_load(s: StepState, n: TaskNode) -> None:
    """A micro-batch's cache layer (home: CPU) into a GPU working copy for GPU attention: only the
    positions this step's attention reads, up to the longest sequence after the step. Where the cache
    is split by slot (flexgen's `kv_gpu_sequences`), only the host's slots cross the link, and the
    GPU's are copied on the device in front of them (as FlexGen's mixed-device cache loads). A layer
    homed on the GPU is attended where it lives: nothing to copy."""
    if n.layer in s.inputs.kv_gpu:
        return
    step = s.inputs[n.mb]
    length = max(step.layout.advanced())
    kept, rest = step.cache.parts(n.layer)
    work = [s.devices.to_gpu(t[:, :, :length]) for t in rest]  # [slots - kept, heads, length, dim]
    if kept is not None:  # [slots, heads, length, dim]
        work = [torch.cat([ours[:, :, :length], theirs]) for ours, theirs in zip(kept, work, strict=True)]
    s.acts.kv_work[(n.layer, n.mb)] = (work[0], work[1])


def _kv_store(s: StepState, n: TaskNode) -> None:
    """This step's new k, v from the GPU working copy back into the home cache: only the tokens of the
    host's slots cross the link where the cache is split by slot (a GPU-homed layer: attention wrote
    them there)."""
    if n.layer in s.inputs.kv_gpu:
        return
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    work = s.acts.kv_work.pop(key)  # the copy back waits for the device, so the working copy is dead after it
    store_kv(step.cache, n.layer, step.layout, *read_kv(*work, s.inputs.layout(n.mb, n.lane)))
    if s.cuda and step.cache.kept:  # the next step's KV_LOAD reads the GPU's slots on another stream
        torch.cuda.current_stream(s.devices.gpu).synchronize()
    s.acts.retire(work)


def _hidden_load(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.acts.attn[key] = s.devices.to_gpu(s.acts.attn[key])


def _act_store(s: StepState, n: TaskNode) -> None:
    """A micro-batch's residual stream to the CPU between layers (FlexGen's activations on the CPU)."""
    s.acts.hidden[n.mb] = s.devices.to_cpu(s.acts.hidden[n.mb])


def _act_load(s: StepState, n: TaskNode) -> None:
    s.acts.hidden[n.mb] = s.devices.to_gpu(s.acts.hidden[n.mb])


def _post_attn(s: StepState, n: TaskNode) -> None:
    key, acts = (n.layer, n.mb), s.acts
    previous = acts.hidden[n.mb]  # may come from another stream (ACT_LOAD): retired on this one
    lw = s.weights.device.layer(n.layer)
    acts.hidden[n.mb], acts.x[key] = s.model.post_attention(n.layer, previous, acts.attn[key], lw)
    acts.retire([previous])


def _gate(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.routings.gate(key, s.acts.x[key], n.layer, s.weights.device.layer(n.layer))


def bind_pregate(s: StepState, n: TaskNode) -> Action:
    """A pre-gate reads an earlier layer's x (ModelSpec.pregate_source): that x is kept until it has."""
    s.acts.read_later((s.model.spec.pregate_source(n.layer), n.mb))
    return partial(_pregate, s, n)


def _pregate(s: StepState, n: TaskNode) -> None:
    """Layer n.layer's router applied to an earlier layer's post-attention hidden state (the MoE
    layer before it, else the layer before: ModelSpec.pregate_source)."""
    source = (s.model.spec.pregate_source(n.layer), n.mb)
    lw = s.weights.device.layer(n.layer)
    s.routings.gate((n.layer, n.mb), s.acts.x[source], n.layer, lw, speculative=True)
    s.acts.release_x(source, reader=True)


def _page_copy(s: StepState, n: TaskNode) -> None:
    """One page or a run of `n.pages` pages of an expert (or a dense part), or whole experts (`n.experts`)."""
    for expert in n.experts or (n.expert,):
        s.weights.device.load(n.layer, expert, n.part, n.parts, n.pages)


def _evict(s: StepState, n: TaskNode) -> None:
    s.weights.device.evict(n.layer, n.expert)


def _lm_head(s: StepState, n: TaskNode) -> None:
    """On a GPU lane with the device's final norm and head; on cpu.compute with the host's."""
    layout, hidden = s.inputs.layout(n.mb, n.lane), s.acts.hidden[n.mb]
    if not layout.is_decode:  # a decode step's every row is its sequence's last: no gather
        hidden = hidden[on(layout.last_rows, s.inputs.place(n.lane))]  # uploaded with the lane's layout
    if not n.lane.on_gpu:
        s.acts.logits[n.mb] = s.model.logits(hidden)
        return
    ends = s.weights.device.head
    assert ends is not None, "the device weights were released (Runtime.close)"
    norm, head = ends
    s.acts.logits[n.mb] = s.devices.to_cpu(s.model.logits(hidden, norm, head))


def _layer(s: StepState, n: TaskNode) -> None:
    """A whole decoder layer on cpu.compute (the `cpu` schedule's node), as the eager model runs it
    (MoEModel.forward_layer), with the host's weights and a cache homed on the host; its routing is
    kept as a gate's is (the runtime's routing record reads it)."""
    if n.lane is not Lane.CPU_COMPUTE:
        raise FlowmoeError(f"{n.label} is on {n.lane}: a whole layer runs on {Lane.CPU_COMPUTE} only")
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    layout, rope = s.inputs.layout(n.mb, n.lane), s.inputs.rope(n.mb, n.lane)
    hidden = s.acts.hidden[n.mb]
    s.acts.hidden[n.mb], _ = s.model.forward_layer(
        n.layer, hidden, step.cache, layout, rope, gated=partial(s.routings.decide, key)
    )


LAYER_OPS = {
    Op.EMBED: _embed,
    Op.PRE_ATTN: _pre_attn,
    Op.QKV_OFFLOAD: _qkv_offload,
    Op.CPU_ATTN: _attention,
    Op.GPU_ATTN: _attention,
    Op.HIDDEN_LOAD: _hidden_load,
    Op.ACT_STORE: _act_store,
    Op.ACT_LOAD: _act_load,
    Op.KV_LOAD: _kv_load,
    Op.KV_STORE: _kv_store,
    Op.POST_ATTN: _post_attn,
    Op.GATE: _gate,
    Op.PAGE_COPY: _page_copy,
    Op.EVICT: _evict,
    Op.LM_HEAD: _lm_head,
    Op.LAYER: _layer,
}
