"""What the host launches per decode step, counted on the CPU: torch operations dispatched and
executor nodes, per scheduler, at the H200 setting of issue 29 and at MoE-Lightning's S1.

Counts, not times: every torch operation the runtime dispatches in a decode step is counted with a
TorchDispatchMode (aten operations after autograd, as the device would be asked to run them; views
counted apart, they launch no kernel) and attributed to the node whose action dispatched it
("outside nodes": the engine and the step's own set-up). Deterministic and machine-independent.

The count does not depend on tensor sizes, only on the plan (layers, micro-batches, routed experts,
pages per expert) and on the code path, so the model is Mixtral-8x7B's structure (8 experts, top-2,
GQA, its layer count) at toy widths (bench/gpu_support.TINY) and the page size is scaled so that an
expert is cut into as many pages as Mixtral's real 352 MB expert at 16 MiB pages (21).

Two columns. *C kernels off*: the native C kernels off everywhere (FLOWMOE_CPU_KERNELS=0), torch
operations on every lane, as the GPU runs them (the count before issue 29's cuts was this one).
*CPU lane as run*: a second pass, where a scheduler puts nodes on the CPU lane (attention at S1,
experts for Fiddler and the like), with the C kernels for those nodes only, as a real run's host
runs them; the GPU lanes' nodes still torch operations. A C kernel dispatches no torch operation;
its wrapper's are counted. The C decode attention is built for AVX-512 hosts only: on a host
without it a stand-in takes its place, the wrapper's operations counted and the attention itself
computed by torch with the counter paused (the row says so: `cpu_attention_stand_in`). On the CPU a "GPU"
weight is the host tensor itself, so the copies a PAGE_COPY makes on CUDA are counted apart: each
PAGE_COPY (and EVICT) node's action runs a second time, as it is, against device weights whose "GPU"
is the meta device (a device other than the host, as CUDA is: the code path that copies), in the
run's own order, and what it dispatches is counted as that node's CUDA copy operations. Other
device-to-device moves (hidden states, the routing read-back) and the eviction's record_stream calls
are free on the CPU and missing here: the count is a lower bound for a CUDA run.

A GPU lane's expert node takes the experts of its group whose copies have run (runtime/lane_weights.py
`taken`) into one grouped GEMM per projection over their weights in place. CUDA takes the same groups
where its copies lie in the device's slot pool (runtime/expert_slots.py; opt-in on CUDA:
FLOWMOE_EXPERT_SLOTS=1): a copy launched is a copy run here, and the waits it adds are no torch
operations. Without the pool CUDA runs each GPU expert at its own node (~10 operations each). The
grouped GEMM's CUDA form dispatches about the CPU form's count (kernels/grouped_experts.py).

    python bench/step_counts.py [--settings h200 s1] [--schedulers cgopipe ...] [--out PATH]

Prints a rich table and writes bench/step_counts.json.
"""

from __future__ import annotations

import os

os.environ["FLOWMOE_CPU_KERNELS"] = "0"  # torch operations everywhere, as on the GPU (see CpuLaneKernels)

import argparse
import asyncio
import json
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import torch
from gpu import SCHEDULERS, cache_slots, generate, requests_for
from gpu_support import bench_spec, fast_model
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Place, Policy
from flowmoe.core.presets import preset
from flowmoe.core.workloads import workload
from flowmoe.jobs.batching import BatchLimits
from flowmoe.jobs.engine import Request, StepInput
from flowmoe.kernels import cpu_attention, cpu_expert, native
from flowmoe.kernels.native import cpuinfo_field
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime import actions
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.layer_ops import LAYER_OPS
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.shared_options import PagedOptions

console = Console(width=200)
REAL_PAGE = 16 * 2**20  # the default page size against Mixtral-8x7B's real expert


@attrs.frozen
class Setting:
    label: str
    layers: int
    prompts: int
    micro_batches: int
    share: float  # experts resident
    attention_on: Place
    lengths: str  # "random:MEAN" (bench/gpu.py's prompts) or a workload name
    source: str


SETTINGS = {
    "h200": Setting("H200 run (issue 29)", 12, 32, 4, 0.25, "gpu", "random:128",
                    "../shared/gpu-runs/2026-11-27-h200: 12 layers, 32 prompts of ~128 tokens, "
                    "4 micro-batches, 25% of experts resident"),
    "s1": Setting("MoE-Lightning S1", 32, 504, 14, 0.0, "cpu", "mtbench",
                  "MoE-Lightning S1 (T4): all 32 layers, MTBench prompts, N = 504, mu = 36 (Table 5), "
                  "attention on the CPU, experts paged"),
}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Every aten operation dispatched while `active`, by the label of the node running it; those of
    the copies a CUDA run makes (`copying`) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.copying = False
        self.label = "outside nodes"
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()
        self.copies: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active and self.copying:
            self.copies[self.label] += 1
        elif self.active:
            self.ops[self.label] += 1
            if func.is_view:
                self.views[self.label] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused(self) -> Iterator[None]:
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        outer, self.label = self.label, label
        try:
            yield
        finally:
            self.label = outer


COPYING = (Op.PAGE_COPY, Op.EVICT)  # the nodes whose actions copy (or free) weights on a GPU
LOOKUPS = (native, cpu_expert, cpu_attention)  # each module's library(): None = torch's path


@attrs.define
class CpuLaneKernels:
    """The C kernels for the CPU lane's nodes only (`on` while one runs; without CUDA every lane
    runs on the event loop's thread, devices/factory.py), torch operations for the others: each
    kernel module's `library()` answers None unless `on`. `install` returns undo."""

    counter: OpCounter
    on: bool = False
    stand_in: bool = False  # this host lacks the C decode attention (AVX-512 only): a stand-in runs

    def install(self) -> Callable[[], None]:
        originals = {m: m.library for m in LOOKUPS}
        os.environ["FLOWMOE_CPU_KERNELS"] = "1"
        found: dict[Any, Any] = {m: _fresh(m) for m in LOOKUPS}
        os.environ["FLOWMOE_CPU_KERNELS"] = "0"
        decode = cpu_attention.decode
        self.stand_in = found[cpu_attention] is None
        if self.stand_in:  # the C call answers "done"; `counted_decode` fills its output uncounted
            found[cpu_attention] = SimpleNamespace(flowmoe_decode_attention=lambda *args: 0)

            def counted_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               sequences: list[tuple[int, int, int, int]], out: torch.Tensor,
                               sinks: torch.Tensor | None, scale: float, chunk: int = cpu_attention.CHUNK,
                               ) -> None:  # fmt: skip
                decode(q, keys, values, sequences, out, sinks, scale, chunk)  # the wrapper's operations
                with self.counter.paused():
                    _decode_attention(q, keys, values, sequences, out, sinks, scale)

            cpu_attention.decode = counted_decode  # type: ignore[assignment]  # a bench's stand-in
        for module in LOOKUPS:
            module.library = partial(lambda lib: lib if self.on else None, found[module])  # type: ignore[assignment]

        def undo() -> None:
            cpu_attention.decode = decode
            for module, lookup in originals.items():
                module.library = lookup
                lookup.cache_clear()

        return undo


def _fresh(module: Any) -> Any:
    module.library.cache_clear()
    return module.library()


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      sequences: list[tuple[int, int, int, int]], out: torch.Tensor,
                      sinks: torch.Tensor | None, scale: float) -> None:  # fmt: skip
    """What cpu_attention.decode computes, in torch: q[row] [H, D] against keys / values [slot, :,
    lo:hi] -> out[row] [H * D]; sinks [H] add exp(sink) to each head's softmax denominator."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    for row, slot, lo, hi in sequences:
        k, v = (t[slot, :, lo:hi].float() for t in (keys, values))  # [kvh, L, D]
        qg = q[row].float().reshape(kv_heads, heads // kv_heads, -1)  # [kvh, g, D]
        scores = (qg @ k.transpose(1, 2)) * scale  # [kvh, g, L]
        if sinks is not None:
            sink = sinks.float().reshape(kv_heads, -1, 1)  # [kvh, g, 1]
            scores = torch.cat([scores, sink], dim=-1)
        weights = scores.softmax(-1)[..., : hi - lo]
        out[row] = (weights @ v).reshape(-1).to(out.dtype)  # [H * D]


def attributing(counter: OpCounter, cuda: Any, lane: CpuLaneKernels | None) -> Callable[[], None]:
    """StepState.action wrapped so each node's binding and run count under its op (with `lane`, the
    CPU lane's nodes with the C kernels on), and a copying node's action runs again against `cuda` (a
    step state whose device weights copy), counted apart; returns undo."""
    original = actions.StepState.action

    @contextmanager
    def running(node: TaskNode) -> Iterator[None]:
        with counter.labelled(node.op.name):
            if lane is None or node.lane is not Lane.CPU_COMPUTE:
                yield
                return
            lane.on = True
            try:
                yield
            finally:
                lane.on = False

    def action(self: actions.StepState, node: TaskNode) -> Any:
        with running(node):
            bound = original(self, node)
        if bound is None:
            return None

        def run() -> Any:
            with running(node):
                result = bound()
                if node.op in COPYING:
                    counter.copying = True
                    try:
                        LAYER_OPS[node.op](cuda, node)
                    finally:
                        counter.copying = False
                return result

        return run

    actions.StepState.action = action  # type: ignore[method-assign]  # a bench's own instrumentation
    return lambda: setattr(actions.StepState, "action", original)


def prompts_for(setting: Setting, vocab: int) -> list[Request]:
    if setting.lengths.startswith("random:"):
        return requests_for(setting.prompts, int(setting.lengths.split(":")[1]), vocab)
    lengths = workload(setting.lengths).sample(setting.prompts, 0)
    generator = torch.Generator().manual_seed(0)
    return [Request(str(i), tuple(torch.randint(3, vocab, (n,), generator=generator).tolist()), i)
            for i, n in enumerate(lengths)]  # fmt: skip


def count(
    setting: Setting, name: str, model: MoEModel, pages: int, decode_steps: int, cpu_lane: bool = False
) -> dict[str, Any]:
    """One scheduler's decode steps at `setting`: operations and nodes per step, by op; `cpu_lane`:
    the CPU lane's nodes with the C kernels (CpuLaneKernels)."""
    requests = prompts_for(setting, model.spec.vocab)
    size = -(-setting.prompts // setting.micro_batches)
    limits = BatchLimits(setting.micro_batches, size, decode_steps + 1)
    page = -(-model.spec.expert_bytes // pages)  # as many pages per expert as the real model's
    policy = Policy(micro_batch_size=size, micro_batches=setting.micro_batches,
                    weights_gpu_share=setting.share, attention_on=setting.attention_on)  # fmt: skip
    policy = policy.with_options(PagedOptions(page_bytes=page))
    slots = max(4, int(setting.share * model.spec.moe.experts * model.spec.layers) // 4 * 4)
    policy = cache_slots(policy, name, slots)
    counter = OpCounter()
    cuda = DeviceWeights(model, Devices(torch.device("meta")))  # copies, as on CUDA: the counted path
    lane = CpuLaneKernels(counter) if cpu_lane else None
    undo_lane = lane.install() if lane is not None else (lambda: None)
    undo = attributing(counter, SimpleNamespace(weights=SimpleNamespace(device=cuda)), lane)
    steps: list[tuple[int, int]] = []  # (first span, end span) of each decode step
    try:
        cost = RooflineCost(hardware("h100" if setting.attention_on == "gpu" else "t4"), model.spec)
        with Runtime.create(model, name, policy, "cpu", cost) as runtime, counter:
            cuda.setup(runtime.scheduler.residency(), runtime.scheduler.weight_buffer_bytes())

            async def counted(m: MoEModel, inputs: list[StepInput]) -> list[torch.Tensor]:
                prefill = any(p == 0 for i in inputs for p in i.layout.past)
                first, counter.active = len(runtime.trace.spans), not prefill
                try:
                    return await runtime(m, inputs)
                finally:
                    counter.active = False
                    if not prefill:
                        steps.append((first, len(runtime.trace.spans)))

            asyncio.run(generate(model, counted, requests, limits, runtime.cache_device))
    finally:
        undo()
        undo_lane()
        cuda.close()
    spans = [s for a, b in steps for s in runtime.trace.spans[a:b]]
    n = len(steps)
    nodes = Counter(s.node.op.name for s in spans)
    pages = sum(s.node.pages if s.node.part >= 0 else 1 for s in spans if s.node.op is Op.PAGE_COPY)
    copies = sum(counter.copies.values())
    return {
        "setting": setting.label, "scheduler": name, "decode_steps": n,
        "nodes_per_step": len(spans) / n, "pages_per_step": pages / n,
        "cpu_lane_nodes_per_step": sum(s.node.lane is Lane.CPU_COMPUTE for s in spans) / n,
        "c_kernels": "cpu lane as run" if cpu_lane else "off",
        "cpu_attention_stand_in": lane is not None and lane.stand_in,
        "ops_per_step": sum(counter.ops.values()) / n,
        "views_per_step": sum(counter.views.values()) / n, "cuda_page_copy_ops_per_step": copies / n,
        "ops_with_copies_per_step": (sum(counter.ops.values()) + copies) / n,
        "cuda_copy_ops_by_op": {k: v / n for k, v in counter.copies.most_common()},
        "nodes_by_op": {k: v / n for k, v in nodes.most_common()},
        "ops_by_op": {k: v / n for k, v in counter.ops.most_common()},
        "policy": {"batch_size": policy.batch_size, "micro_batch_size": size,
                   "micro_batches": setting.micro_batches, "weights_gpu_share": setting.share,
                   "attention_on": setting.attention_on, "page_bytes_scaled": page,
                   "pages_per_expert": pages},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--s1-schedulers", nargs="+", help="at S1 only these (default: --schedulers)")
    parser.add_argument("--decode-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/step_counts.json"))
    args = parser.parse_args()
    real = preset("mixtral-8x7b", dtype="bfloat16")
    pages = -(-real.expert_bytes // REAL_PAGE)
    rows = []
    for key in args.settings:
        setting = SETTINGS[key]
        model = fast_model(bench_spec("mixtral-8x7b", setting.layers, "bfloat16", tiny=True))
        for name in (args.s1_schedulers or args.schedulers) if key == "s1" else args.schedulers:
            started = time.perf_counter()
            try:
                row = count(setting, name, model, pages, args.decode_steps)
                if row["cpu_lane_nodes_per_step"]:  # the second column: the CPU lane as run
                    row["cpu_lane_as_run"] = count(setting, name, model, pages, args.decode_steps, True)
            except Exception as exc:  # a scheduler that refuses the setting is a row with its reason
                row = {"setting": setting.label, "scheduler": name, "error": f"{type(exc).__name__}: {exc}"}
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
            as_run = row.get("cpu_lane_as_run", row)
            console.print(f"{setting.label} {name}: " + (row.get("error") or (
                f"{row['ops_with_copies_per_step']:.0f} ops/step (C kernels off), "
                f"{as_run['ops_with_copies_per_step']:.0f} (CPU lane as run)")))  # fmt: skip
    show(rows)
    settings = {k: attrs.asdict(SETTINGS[k]) for k in args.settings}
    meta = {"cpu": cpuinfo_field("model name") or platform.processor(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "head": head(),
            "settings": settings}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def head() -> str:
    """The commit counted (with "+" where the tree has changes), or "" outside a git checkout."""
    git = ["git", "-C", str(Path(__file__).parent)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        status = [*git, "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, capture_output=True).stdout
    except OSError:
        return ""
    return commit.strip() + ("+" if dirty else "")


def show(rows: list[dict[str, Any]]) -> None:
    table = Table(title="Per decode step: torch operations and executor nodes (counted on the CPU)")
    for column in ("setting", "scheduler", "nodes", "page copies (pages)", "expert FFNs", "CPU lane nodes",
                   "torch ops", "of them views", "+ CUDA copy ops", "total (C kernels off)",
                   "total (CPU lane as run)", "ops / node", "top ops by node"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["setting"], r["scheduler"], *[""] * 10, r["error"][:60])
            continue
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(r["ops_by_op"].items())[:3])
        as_run = r.get("cpu_lane_as_run", r)
        attends = as_run["cpu_attention_stand_in"] and r["nodes_by_op"].get("CPU_ATTN")
        stand_in = " (stand-in attention)" if attends else ""
        table.add_row(
            r["setting"], r["scheduler"], f"{r['nodes_per_step']:.0f}",
            f"{r['nodes_by_op'].get('PAGE_COPY', 0):.0f} ({r['pages_per_step']:.0f})",
            f"{r['nodes_by_op'].get('EXPERT_FFN', 0):.0f}", f"{r['cpu_lane_nodes_per_step']:.0f}",
            f"{r['ops_per_step']:.0f}", f"{r['views_per_step']:.0f}",
            f"{r['cuda_page_copy_ops_per_step']:.0f}", f"{r['ops_with_copies_per_step']:.0f}",
            f"{as_run['ops_with_copies_per_step']:.0f}{stand_in}",
            f"{r['ops_with_copies_per_step'] / r['nodes_per_step']:.1f}", top,
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
