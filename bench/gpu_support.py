"""Pieces of bench/gpu.py: link peaks, the model made fast, the simulator's prediction, the
Accelerate offload baseline, the rows written as they finish and the RESULTS.md rows."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from attrs import define, evolve, field

from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy
from flowmoe.core.presets import PRESET_CONFIGS
from flowmoe.core.scheduling import BatchShape
from flowmoe.core.spec import ModelSpec
from flowmoe.core.workloads import LengthDistribution, Workload
from flowmoe.model.arena import layer_arena, top_arena
from flowmoe.model.checkpoint import TORCH_DTYPES
from flowmoe.model.loading import Packing, layer_packer
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import Shape, TensorMap
from flowmoe.study.simulate import Setup, Simulation, batch_steps

SECTION = "## CUDA path: the last GPU run (bench/gpu.py)"
PERIOD = 1_048_573  # a prime: the length of the random block every tensor is read from
STRIDE = 257  # values from one row of a tensor to the next in that block
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 512}  # fmt: skip


def bench_spec(model: str, layers: int, dtype: str, tiny: bool) -> ModelSpec:
    """The preset's spec cut to `layers` (with --tiny: Mixtral's structure at toy widths)."""
    config = {**PRESET_CONFIGS[model], "num_hidden_layers": layers, "_name_or_path": model}
    if tiny:
        config |= {**TINY, "_name_or_path": f"{model}-tiny"}
    return ModelSpec.from_hf(config).with_dtype(dtype)


@define
class TiledSource(RandomSource):
    """Random weights at no cost of their own: every tensor is a strided view of one shared buffer,
    a N(0, std) block of PERIOD values repeated, read from a phase its name picks, each row STRIDE
    values on from the one before (deterministic; rows are distinct shifts of the random block).
    The only copies are the packing into each layer's buffer that any loaded model makes.
    Norms are ones, as RandomSource makes them."""

    _buffers: dict[torch.dtype, torch.Tensor] = field(factory=dict)

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return super().get(name, shape)
        dims = tuple(shape) or (1,)
        rows, cols = math.prod(dims[:-1]), dims[-1]
        buffer = self._buffer(TORCH_DTYPES[self.spec.dtype], rows * STRIDE + cols)
        phase = zlib.crc32(name.encode()) % PERIOD
        view = buffer.as_strided((rows, cols), (STRIDE, 1), phase)  # [rows, cols]
        return view.reshape(shape) if len(dims) == 2 else view.contiguous().view(shape)

    def _buffer(self, dtype: torch.dtype, reach: int) -> torch.Tensor:
        """The shared buffer, at least PERIOD + `reach` values long (grown by doubling copies)."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < PERIOD + reach:
            generator = torch.Generator().manual_seed(self.seed)
            block = (torch.randn(PERIOD, generator=generator) * self.std).to(dtype)  # [PERIOD]
            buffer = torch.empty(max(2 * PERIOD, PERIOD + reach), dtype=dtype)
            buffer[:PERIOD] = block
            done = PERIOD
            while done < buffer.numel():
                step = min(done, buffer.numel() - done)
                buffer[done : done + step] = buffer[:step]
                done += step
            self._buffers[dtype] = buffer
        return buffer


def fast_model(spec: ModelSpec, packing: Packing | None = None) -> MoEModel:
    """`spec` with TiledSource weights, packed per layer as flowmoe.model.loading packs them (its
    routed experts quantized on `packing.device` where `packing` says, as `--expert-format` does)."""
    source, tensor_map = TiledSource(spec), TensorMap.for_spec(spec)
    pack = layer_packer(spec.name, source, spec, packing or Packing())
    layers = []
    for layer in range(spec.layers):
        weights = tensor_map.load_layer(layer, source)
        layer_arena(weights)
        pack(layer, weights)
        layers.append(weights)
    top = tensor_map.load_top(source, layers)
    top_arena(top)
    return MoEModel.build(spec, top)


def predict(spec: ModelSpec, machine: str, name: str, policy: Policy, batch: BatchShape) -> dict[str, Any]:
    """The simulator's tokens/s for the same model, policy and batch (its micro-batches as the engine
    plans them, every decode step simulated) on the preset hardware `machine`."""
    lengths = [n for group in batch.prompts for n in group]
    mu = max(len(group) for group in batch.prompts)
    shape = LengthDistribution(sum(lengths) / len(lengths), max(lengths), min(lengths))
    workload = Workload("bench", shape, batch.gen, (batch.gen,), "bench/gpu.py's prompts")
    policy = evolve(policy, micro_batch_size=mu, micro_batches=len(batch.prompts))
    simulation = Simulation(Setup(spec, hardware(machine), workload, policy, decode_samples=0))
    padded = [n for group in batch.prompts for n in [*group, *[group[0]] * (mu - len(group))]]
    simulation.prompts = padded  # the engine's grouping, full micro-batches
    simulation.steps = batch_steps(padded, batch.gen, mu)
    result = simulation.run(name)
    if result.error is not None:
        return {"predicted_error": result.error}
    return {"predicted_tokens_per_s": result.throughput, "predicted_decode_s": result.decode_seconds,
            "predicted_prefill_s": result.prefill_seconds}  # fmt: skip


class RowLog:
    """JSON Lines written as each row finishes (flushed and synced: a killed run keeps its rows)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def add(self, kind: str, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"kind": kind, **record}, default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def link_peaks(device: str, tiny: bool) -> dict[str, float]:
    """Best of five copies of one buffer: pinned and pageable H2D, pinned D2H (bytes/s).
    Without CUDA, host memcpy stands in (a dry run)."""
    size = (16 if tiny else 512) * 2**20
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device == "cuda")
    pageable = torch.empty(size, dtype=torch.uint8)
    target = torch.empty(size, dtype=torch.uint8, device=device)

    def best(copy) -> float:
        times = []
        for _ in range(5):
            if device == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                copy()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
            else:
                started = time.perf_counter()
                copy()
                times.append(time.perf_counter() - started)
        return size / min(times)

    return {
        "h2d_pinned": best(lambda: target.copy_(pinned, non_blocking=True)),
        "h2d_pageable": best(lambda: target.copy_(pageable)),
        "d2h_pinned": best(lambda: pinned.copy_(target, non_blocking=True)),
    }


# shares of the budget offered to Accelerate's device map, largest first: its auto map fills
# max_memory with weights and leaves generate() no room (at 16 GiB, 32 prompts' fp32 prefill logits
# alone are ~0.8 GiB), so a user lowers max_memory until generate runs; the row says which share ran
ACCELERATE_SHARES = (0.9, 0.8, 0.7, 0.6, 0.5)


def accelerate_baseline(spec: ModelSpec, requests: list, new_tokens: int, device: str, budget: int) -> dict:
    """transformers + accelerate as `from_pretrained(device_map="auto", max_memory=...)` sets a model
    up (an auto device map under the same GPU budget, the rest offloaded to the CPU and streamed in
    by accelerate's hooks), built from the config in memory with the same tiled random weights
    rather than through a checkpoint on disk; same prompts, greedy. The device map is offered the
    largest of ACCELERATE_SHARES of the budget under which generate() runs out of no memory, as a
    user would lower max_memory. Needs accelerate."""
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return {"status": f"skipped: {exc.name} is not installed"}
    tried = []
    for share in ACCELERATE_SHARES if device == "cuda" else (1.0,):
        try:
            row = accelerate_generate(spec, requests, new_tokens, device, int(share * budget))
        except torch.cuda.OutOfMemoryError:
            row = None
        if row is not None:
            return {**row, "max_memory_share": share}
        # out of the except block, the failed attempt's frames (and the model they hold on the GPU)
        # are gone: freed here, not held into the next attempt (the H200 run's five OOMs)
        tried.append(f"{share:.0%}")
        gc.collect()
        torch.cuda.empty_cache()
    shares = ", ".join(tried)
    return {"status": "error", "error": f"CUDA out of memory with max_memory at {shares} of the budget"}


def accelerate_generate(
    spec: ModelSpec, requests: list, new_tokens: int, device: str, max_memory: int
) -> dict:
    """One Accelerate offload run with `max_memory` bytes of GPU for its device map."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = TORCH_DTYPES[spec.dtype]
    config = AutoConfig.for_model("mixtral", **{**spec_config(spec), "dtype": spec.dtype})
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    source, started = TiledSource(spec), time.perf_counter()
    for name, param in list(model.named_parameters()):  # the meta parameters, as from_pretrained loads
        set_module_tensor_to_device(model, name, "cpu", value=source.get(name, tuple(param.shape)))
    model.eval()
    setup_s = time.perf_counter() - started
    memory: dict[int | str, int] = {0: max_memory} if device == "cuda" else {}
    device_map = infer_auto_device_map(
        model, max_memory={**memory, "cpu": 2**40}, no_split_module_classes=model._no_split_modules
    )
    model = dispatch_model(model, device_map=device_map)
    width = max(len(r.input_ids) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(requests):  # left padding
        ids[row, width - len(request.input_ids) :] = torch.tensor(request.input_ids)
        mask[row, width - len(request.input_ids) :] = 1
    first = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(ids.to(first), attention_mask=mask.to(first), max_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    elapsed = time.perf_counter() - started
    on_gpu = sum(1 for where in device_map.values() if where not in ("cpu", "disk"))
    return {"status": "ok", "tokens_per_s": len(requests) * new_tokens / elapsed, "decode_s": elapsed,
            "setup_s": setup_s, "modules_on_gpu": on_gpu, "modules": len(device_map)}  # fmt: skip


def spec_config(spec: ModelSpec) -> dict[str, Any]:
    """The transformers config of a Mixtral-structured spec (bench_spec's)."""
    name = spec.name.removesuffix("-tiny")
    config = {**PRESET_CONFIGS[name], "num_hidden_layers": spec.layers}
    if spec.name.endswith("-tiny"):
        config |= TINY
    return {k: v for k, v in config.items() if k != "architectures"}


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def write_results(path: Path, meta: dict, peaks: dict, rows: list[dict]) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md, other sections untouched."""
    lines = [
        SECTION,
        "",
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}; {meta['model']}.",
        "Link peaks measured in the same run: "
        + ", ".join(f"{name} {value / 1e9:.1f} GB/s" for name, value in peaks.items())
        + ".",
        "",
        "| budget | scheduler | expert share resident | tokens/s | predicted (measured / predicted) "
        "| H2D busy (decode) | H2D GB/s (of pinned peak) | makespan / busiest lane "
        "| GiB accounted / allocator peak | tokens = CPU path |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            why = (r.get("error") or r.get("status", "")).split(". ")[0]  # the first sentence
            lines.append(
                f"| {r['budget']} | {r['scheduler']} | | | | | {why} | | | {r.get('tokens_match_cpu', '')} |"
            )
            continue
        if "modules" in r:  # Accelerate's offload: no trace, no flowmoe accounting, no prediction
            on_gpu, share = f"{r['modules_on_gpu']} of {r['modules']}", r["max_memory_share"]
            placed = f"{on_gpu} device-map entries on the GPU (max_memory {share:.0%})"
            lines.append(f"| {r['budget']} | {r['scheduler']} | {placed} | {r['tokens_per_s']:.1f} "
                         "| - | - | - | - | - | - |")  # fmt: skip
            continue
        predicted = r.get("predicted_tokens_per_s")
        guess = (
            f"{predicted:.1f} ({r['measured_over_predicted']:.2f})"
            if predicted
            else r.get("predicted_error", "")
        )
        lines.append(
            f"| {r['budget']} | {r['scheduler']} | {r.get('share', '')} | {r['tokens_per_s']:.1f} | {guess} "
            f"| {r.get('h2d_busy', 0):.0%} | {r.get('h2d_gbps', 0):.1f} ({r.get('h2d_of_peak', 0):.0%}) "
            f"| {r.get('overlap', 0):.2f} "
            f"| {gib(r.get('accounted_bytes'))} / {gib(r.get('peak_allocated_bytes'))} "
            f"| {r.get('tokens_match_cpu', '')} |"
        )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(lines) + "\n"
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    text = pattern.sub(block.rstrip("\n"), text) if SECTION in text else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")
