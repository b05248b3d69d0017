"""Pieces of bench/gpu.py: link peaks, the Accelerate offload baseline, the RESULTS.md rows."""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowmoe.core.presets import PRESET_CONFIGS, preset
from flowmoe.model.random_weights import RandomSource
from flowmoe.model.tensor_map import TensorMap

SECTION = "## CUDA path (bench/gpu.py)"


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


def export_checkpoint(model_name: str, layers: int, folder: Path) -> Path:
    """The preset's random weights (the same ones flowmoe loads for it) as a transformers checkpoint,
    one shard per layer, per-expert layout."""
    spec = preset(model_name, layers=layers, dtype="bfloat16")
    source, tensor_map = RandomSource(spec), TensorMap.for_spec(spec)
    weight_map: dict[str, str] = {}
    groups = [tensor_map.top_level()] + [tensor_map.layer_tensors(i, source.has) for i in range(layers)]
    for index, shapes in enumerate(groups):
        shard = f"model-{index:05d}.safetensors"
        save_file(
            {n: source.get(n, s) for n, s in shapes.items()}, str(folder / shard), metadata={"format": "pt"}
        )
        weight_map |= dict.fromkeys(shapes, shard)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {
        **PRESET_CONFIGS[model_name],
        "num_hidden_layers": layers,
        "model_type": "mixtral",
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def accelerate_baseline(args, requests, budget: int) -> dict:
    """transformers + accelerate: device_map offload under the same GPU budget, same prompts, greedy."""
    try:
        import accelerate  # noqa: F401
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        return {"status": f"skipped: {exc.name} is not installed"}
    with tempfile.TemporaryDirectory(prefix="flowmoe-accelerate-") as tmp:
        folder = export_checkpoint(args.model, args.layers, Path(tmp))
        gpu = {0: budget} if args.device == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            folder, device_map="auto", max_memory={**gpu, "cpu": 2**40}, dtype=torch.bfloat16
        ).eval()
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
            model.generate(ids.to(first), attention_mask=mask.to(first), max_new_tokens=args.new_tokens,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        elapsed = time.perf_counter() - started
    return {"status": "ok", "tokens_per_s": len(requests) * args.new_tokens / elapsed, "decode_s": elapsed}


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
        "| budget | scheduler | expert share resident | tokens/s | H2D busy (decode) "
        "| H2D GB/s (of pinned peak) | makespan / busiest lane | GiB accounted / allocator peak "
        "| tokens = CPU path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['budget']} | {r['scheduler']} | | | | {r.get('status', '')} | | | |")
            continue
        lines.append(
            f"| {r['budget']} | {r['scheduler']} | {r.get('share', '')} | {r['tokens_per_s']:.1f} "
            f"| {r.get('h2d_busy', 0):.0%} | {r.get('h2d_gbps', 0):.1f} ({r.get('h2d_of_peak', 0):.0%}) "
            f"| {r.get('overlap', 0):.2f} "
            f"| {gib(r.get('accounted_bytes'))} / {gib(r.get('peak_allocated_bytes'))} "
            f"| {r.get('tokens_match_cpu', '')} |"
        )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(lines) + "\n"
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    text = pattern.sub(block.rstrip("\n"), text) if SECTION in text else text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
