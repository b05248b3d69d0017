"""`cpu`: the whole model on the host's CPU, one node per decoder layer: what a host without a GPU runs.

Every weight and the KV cache stay in host memory and every node runs on `cpu.compute`: each
micro-batch's EMBED, then layer after layer (micro-batch after micro-batch, in model order) one LAYER
node that runs the whole decoder layer (pre-attention, attention over its cache, post-attention, the
router, the routed and shared experts, the combine) in one action, then its LM_HEAD. This is the
shape of a CPU-only llama.cpp run (one graph a token, no overlap to plan), and the shape that costs
the host least: on one device with one lane nothing can overlap, so finer nodes would only add the
runtime's per-node work (plan, executor, bookkeeping: ~0.9-1.2 ms of a batch-1 decode step of issue
25's checkpoint, bench/RESULTS.md session 23). Its tokens are eager's (the same kernels in the same
order: MoEModel.forward_layer); its trace has one span per layer.

The routing is decided inside a LAYER node, so the plan asks for none; the simulator prices a LAYER
by its parts, its routed experts as the distinct experts its tokens are expected to pick when each
token picks top_k of E at random (NodeFactory). `--attention-on` and `--ffn-on` do not apply (all of
it is on the CPU).
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import Lane, Op
from flowmoe.core.scheduling import BatchShape, PlanStream, Residency, Scheduler, StepShape


class CpuScheduler(Scheduler):
    name: ClassVar[str] = "cpu"
    summary: ClassVar[str] = "the whole model on the CPU, one node per decoder layer (no GPU used)"

    def residency(self) -> Residency:
        return Residency()

    def uses_gpu(self) -> bool:
        return False

    def kv_on_gpu(self) -> bool:
        return False

    def kv_working_bytes(self, batch: BatchShape, step: StepShape) -> int:
        return 0  # attention runs on the CPU beside the cache: no working copy on the GPU

    def plan(self, step: StepShape) -> PlanStream:
        f, cpu = self.context.factory, Lane.CPU_COMPUTE
        embeds = [f.node(Op.EMBED, cpu, mb=mb) for mb in step.micro_batches]
        yield from embeds
        last = {
            mb.index: node.id for mb, node in zip(step.micro_batches, embeds, strict=True)
        }  # mb -> its last node
        for layer in range(self.context.spec.layers):
            for mb in step.micro_batches:
                node = f.node(Op.LAYER, cpu, layer, mb, deps=[last[mb.index]])
                yield node
                last[mb.index] = node.id
        for mb in step.micro_batches:
            yield f.node(Op.LM_HEAD, cpu, mb=mb, deps=[last[mb.index]])
