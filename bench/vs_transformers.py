"""flowmoe against transformers' `generate` on the CPU: same checkpoint, prompts and batch, greedy.

A Mixtral-shaped checkpoint with random weights (hidden 768, 6 layers, 8 experts top-2, fp32; issue
15) is written once with transformers' save_pretrained; a batch of 16 mixed-length prompts then runs
  * through transformers `generate` (left padding + attention mask, its default experts
    implementation),
  * through `flowmoe run`'s path: the dataflow runtime with the `eager` scheduler and default
    settings (Runtime.create with a default Policy, driven by the Engine, as `flowmoe run` builds
    it; prompts packed without padding), and
  * through flowmoe's plain `eager_step` (the same model code, no runtime; the Engine on uvloop's
    event loop for both flowmoe runners, as `flowmoe run` runs it),
with default threads (the thread plan's; OMP_NUM_THREADS narrows it), the checkpoint's weights
converted to each --dtypes the same way on both sides.

The three run in one process, each on the main thread (as `flowmoe run` and a transformers script
do), interleaved run by run (A B C A B C ...), so a load change on a shared machine hits all three
alike across the repeats. A step of transformers is the time between two tokens its streamer
receives; a step of flowmoe the time between two calls of its step runner (the engine's sampling
included on both sides). Decode = incremental steps 2..N (prefill excluded); end-to-end = every
step of the run, prefill included.
Each measured run is repeated (--repeats), after one warm-up run of each that is not counted; best
and median of the repeats are reported, with the run-to-run spread (max / min - 1). Prints a rich
table, writes bench/vs_transformers.json and the `## vs transformers (CPU)` section of
bench/RESULTS.md (its `###` subsections, written by hand, are kept).

    python bench/vs_transformers.py            # fp32 and bf16, 3 repeats (several minutes on 2 cores)
    python bench/vs_transformers.py --quick    # a small model, one dtype, to check the script (< 2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import uvloop
from rich.console import Console
from rich.table import Table

from flowmoe.core.threads import usable_cores
from flowmoe.devices.factory import host_plan
from flowmoe.devices.threadpool import set_intra_op
from flowmoe.jobs.batching import BatchLimits, Request
from flowmoe.jobs.engine import Engine, StepInput, eager_step
from flowmoe.kernels.native import cpuinfo_field
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import default_name

HERE = Path(__file__).parent
SECTION = "## vs transformers (CPU)"
NOTES = """
* **Threads** (flowmoe/core/threads.py, docs/architecture.md "Threads on the host"): without CUDA
  the runtime runs every lane's nodes on the event loop's thread with the whole thread budget, so a
  `flowmoe run` step runs the same ops on the same OpenMP team as `eager_step`; before, each lane
  had a thread of its own at every core's worth of OpenMP threads (oversubscribed) and every node
  and routing answer crossed threads. A layer's experts run in one kernel call on both paths
  (actions.py groups the expert nodes bound to one lane).
* **What the runtime still adds over eager_step**: the model's own methods take the same time on
  both paths; the rest is the eager plan's 80 nodes a step (48 of them expert nodes, which one
  grouped kernel call serves) passing through the scheduler, the executor and the actions' tensor
  bookkeeping in Python. Measured and cut in "### The runtime's host time per step" below.
* **Why one thread** (measured 2026-11-24 ~01:07 UTC, load 0.8-1.6, fp32, eager_step alone, 20
  steps): libgomp gives every thread that enters a parallel region an OpenMP team of its own, and
  once the process holds more OpenMP threads than cores it lets a finished team's workers spin only
  briefly (its throttled spin count) before they sleep on a futex, so each parallel region must wake
  them again. eager_step on the main thread: 84 ms/step, ~40 context switches a step; the same on a
  second thread (the main thread's team still alive), or on the main thread while another thread's
  team is parked: 154-159 ms/step, ~1650 context switches a step; OMP_WAIT_POLICY=passive on the
  main thread alone (never spin) gives the same 156 ms. GOMP_SPINCOUNT does not lift the throttle,
  and OMP_WAIT_POLICY=active makes the parked teams spin on the cores. flowmoe's steps run many short
  parallel regions (its C kernels, small ops), so they pay this more than transformers' fewer,
  larger ones: an earlier version of this script ran the three in lockstep, each on a thread of its
  own, and measured eager_step at 113 ms/step vs transformers' 123 (1.09x) where, standalone on the
  main thread, they run 83 vs 108 ms/step (1.30x). Hence every runner here runs on the main thread.
* **Shared machine.** On a loaded machine an OpenMP parallel region waits for its second thread
  whenever another process holds the other vCPU, so absolute times and the spread are the load's;
  the runs are interleaved so that each runner meets the same load across the repeats.
"""
RUNNERS = ("transformers generate", "flowmoe run (runtime, eager)", "flowmoe eager_step")
console = Console(width=None if sys.stdout.isatty() else 160)
Tokens = list[list[int]]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument(
        "--intermediate", type=int, default=2688, help="expert width (Mixtral's 14336/4096 = 3.5 × hidden)"
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-lengths", default="16:128", help="MIN:MAX prompt tokens (uniform)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each runner per dtype")
    parser.add_argument("--checkpoint", type=Path, help="reuse (or write once into) this folder")
    parser.add_argument("--quick", action="store_true", help="a small model, fp32 only (checks the script)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the JSON and RESULTS.md")
    parser.add_argument("--from-json", action="store_true", help="rewrite RESULTS.md from the last JSON only")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab = 512, 1024, 2, 512
        args.new_tokens, args.prompt_lengths, args.repeats, args.dtypes = 8, "4:24", 3, "float32"
    return args


def write_checkpoint(args: argparse.Namespace, folder: Path) -> None:
    """A Mixtral-shaped fp32 checkpoint with random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=2,
        head_dim=128, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    low, high = (int(n) for n in args.prompt_lengths.split(":"))
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(low, high + 1, (args.batch,), generator=generator).tolist()
    return [torch.randint(3, args.vocab, (n,), generator=generator).tolist() for n in lengths]


class Clock:
    """A run's step boundaries: the time between two ticks is one step."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._began = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.steps.append(now - self._began)
        self._began = now


class Streamer:
    """transformers' streamer hook: each token batch it receives is a step boundary."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def put(self, value: torch.Tensor) -> None:
        self.clock.tick()

    def end(self) -> None:
        pass


def hf_generate(model, batch: list[list[int]], new_tokens: int, streamer: Streamer | None = None) -> Tokens:
    """Left padding and an attention mask, as a batch of mixed lengths is fed to `generate`."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)  # [B, width]
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            streamer=streamer,
        )  # fmt: skip
    return out[:, width:].tolist()


Runner = Callable[[MoEModel, Sequence[StepInput]], object]


def flowmoe_generate(
    model: MoEModel, runner: Runner, batch: list[list[int]], new_tokens: int, clock: Clock | None = None
) -> Tokens:
    """The whole batch in one micro-batch (`flowmoe run --batch-size 16`), prompts packed without
    padding; a step's first call of the step runner is a step boundary (a prefill in chunks calls it
    once per chunk: jobs/prefill_chunks.py)."""
    requests = [Request(str(i), tuple(p), i) for i, p in enumerate(batch)]
    limits = BatchLimits(micro_batches=1, micro_batch_size=len(batch), max_new_tokens=new_tokens)
    first = [True]  # the next runner call is a step's first

    async def step(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        if clock is not None and first[0]:
            clock.tick()
        first[0] = False
        return await runner(m, inputs)  # type: ignore[misc]

    def stepped(tokens: int) -> None:
        first[0] = True

    async def go() -> dict[str, tuple[int, ...]]:
        homes = runner.cache_device if isinstance(runner, Runtime) else "cpu"
        engine = Engine(model, step, max_new_tokens=new_tokens, stop_ids=frozenset(),
                        cache_device=homes, on_step=stepped)  # fmt: skip
        return {r.id: r.output_ids async for r in engine.generate(requests, limits)}

    out = uvloop.run(go())  # `flowmoe run`'s loop
    return [list(out[str(i)]) for i in range(len(batch))]


def agreement(ours: Tokens, reference: Tokens) -> tuple[int, float]:
    """(sequences identical, share of tokens equal up to each sequence's first difference)."""
    same, agreed = 0, 0
    for a, b in zip(ours, reference, strict=True):
        same += a == b
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same, agreed / sum(len(r) for r in reference)


def one_repeat(
    runs: dict[str, Callable[[Clock], Tokens]],
) -> tuple[dict[str, list[float]], dict[str, Tokens]]:
    """One run of each in turn, on this thread: each run's step times and tokens."""
    steps: dict[str, list[float]] = {}
    tokens: dict[str, Tokens] = {}
    for name, run in runs.items():
        clock = Clock()
        tokens[name] = run(clock)
        clock.tick()  # what the run does after its last step
        steps[name] = clock.steps
    return steps, tokens


def bench_dtype(args: argparse.Namespace, folder: Path, dtype: str, threads: int) -> list[dict]:
    """Both sides load the same folder, converting its fp32 weights to `dtype` the same way."""
    from transformers import MixtralForCausalLM

    batch = prompts(args)
    hf = MixtralForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # every run generates exactly --new-tokens tokens
    ours = load_model(folder, dtype)
    runtime = Runtime.create(ours, default_name(cuda=False), device="cpu", record=False)  # as `flowmoe run`
    new = args.new_tokens
    runs: dict[str, Callable[[Clock], Tokens]] = {
        RUNNERS[0]: lambda clock: hf_generate(hf, batch, new, Streamer(clock)),
        RUNNERS[1]: lambda clock: flowmoe_generate(ours, runtime, batch, new, clock),
        RUNNERS[2]: lambda clock: flowmoe_generate(ours, eager_step, batch, new, clock),
    }
    repeats: list[dict[str, list[float]]] = []
    failures: list[str] = []
    try:
        for repeat in range(args.repeats + 1):  # run 0 warms up (first touch, lazy setup): not counted
            try:
                steps, tokens = one_repeat(runs)
            except Exception as exc:  # a run that fails is reported and left out; the others count
                failures.append(f"{type(exc).__name__}: {exc}")
                console.print(f"  repeat {repeat} failed (left out): {failures[-1]}")
                continue
            line = ", ".join(f"{n} decode {sum(decode_steps(steps[n], new)):.3f} s" for n in RUNNERS)
            console.print(f"  {f'repeat {repeat}' if repeat else 'warm-up (not counted)'}: {line}")
            if repeat:
                repeats.append(steps)
    finally:
        runtime.close()
    if not repeats:
        raise RuntimeError(f"{dtype}: every run failed: {failures[0]}")
    rows = rows_for(args, dtype, threads, repeats, tokens)
    for row in rows:
        row["failed_runs"] = failures
    return rows


def decode_steps(steps: list[float], new_tokens: int) -> list[float]:
    """Incremental decode steps 2..N: a run's steps are its setup, its prefill (token 1), one step
    per further token, then what the run does after its last token."""
    return steps[2 : new_tokens + 1]


def rows_for(args: argparse.Namespace, dtype: str, threads: int, repeats: list[dict[str, list[float]]],
             tokens: dict[str, Tokens]) -> list[dict]:  # fmt: skip
    reference = tokens[RUNNERS[0]]
    decoded = args.batch * (args.new_tokens - 1)
    new = args.new_tokens
    decode = {n: [sum(decode_steps(r[n], new)) for r in repeats] for n in RUNNERS}
    total = {n: [sum(r[n]) for r in repeats] for n in RUNNERS}
    hf_decode, hf_total = statistics.median(decode[RUNNERS[0]]), statistics.median(total[RUNNERS[0]])
    eager_decode = statistics.median(decode[RUNNERS[2]])
    rows = []
    for name in RUNNERS:
        own = [decode_steps(r[name], new) for r in repeats]
        theirs = [decode_steps(r[RUNNERS[0]], new) for r in repeats]
        paired = [h / o for hs, os_ in zip(theirs, own, strict=True) for h, o in zip(hs, os_, strict=True)]
        same, agreed = agreement(tokens[name], reference)
        median_decode = statistics.median(decode[name])
        rows.append({
            "dtype": dtype, "threads": threads, "runner": name,
            "decode_best_s": min(decode[name]), "decode_median_s": median_decode,
            "decode_tokens_per_s": decoded / median_decode,
            "decode_step_median_ms": 1e3 * statistics.median(s for steps in own for s in steps),
            "decode_vs_transformers": hf_decode / median_decode,
            "decode_vs_transformers_per_step": statistics.median(paired),
            "decode_vs_eager_step": median_decode / eager_decode,
            "decode_vs_eager_step_best": min(decode[name]) / min(decode[RUNNERS[2]]),
            "decode_spread": max(decode[name]) / min(decode[name]) - 1,
            "e2e_best_s": min(total[name]), "e2e_median_s": statistics.median(total[name]),
            "e2e_vs_transformers": hf_total / statistics.median(total[name]),
            "e2e_spread": max(total[name]) / min(total[name]) - 1,
            "identical_sequences": same, "token_agreement": agreed,
            "decode_s_each_repeat": decode[name], "e2e_s_each_repeat": total[name],
        })  # fmt: skip
    return rows


COLUMNS = (
    ("dtype", "dtype", "{}"),
    ("runner", "runner", "{}"),
    ("decode s (best / median)", None, None),
    ("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
    ("ms/step", "decode_step_median_ms", "{:.1f}"),
    ("× transformers decode", "decode_vs_transformers", "{:.2f}"),
    ("per-step × (median)", "decode_vs_transformers_per_step", "{:.2f}"),
    ("÷ eager_step (median / best)", None, None),
    ("spread", "decode_spread", "{:.1%}"),
    ("end-to-end s (best / median)", None, None),
    ("× transformers e2e", "e2e_vs_transformers", "{:.2f}"),
    ("e2e spread", "e2e_spread", "{:.1%}"),
    ("same sequences", None, None),
    ("token agreement", "token_agreement", "{:.1%}"),
)


def cells(row: dict, batch: int) -> list[str]:
    out = []
    for title, key, form in COLUMNS:
        if title.startswith("decode s"):
            out.append(f"{row['decode_best_s']:.2f} / {row['decode_median_s']:.2f}")
        elif title.startswith("end-to-end"):
            out.append(f"{row['e2e_best_s']:.2f} / {row['e2e_median_s']:.2f}")
        elif title.startswith("÷ eager_step"):
            best = row.get("decode_vs_eager_step_best", float("nan"))  # JSON from before it was kept: nan
            out.append(f"{row['decode_vs_eager_step']:.3f} / {best:.3f}")
        elif title == "same sequences":
            out.append(f"{row['identical_sequences']}/{batch}")
        else:
            out.append(form.format(row[key]))
    return out


def table(rows: list[dict], meta: dict) -> Table:
    out = Table(title=f"flowmoe vs transformers — {meta['model']} — {meta['threads']}")
    for title, _, _ in COLUMNS:
        out.add_column(title, justify="left" if title in ("dtype", "runner") else "right")
    for row in rows:
        out.add_row(*cells(row, meta["batch"]))
    return out


def write_results(path: Path, rows: list[dict], meta: dict) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md, other sections untouched."""
    lines = [
        SECTION,
        "",
        f"`python bench/vs_transformers.py{meta['command']}` — {meta['machine']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}, {meta['date']}; {meta['threads']}; load average "
        f"{meta['load_before']} before, {meta['load_after']} after (the machine is shared).",
        f"Model: {meta['model']} (random weights, written by transformers' save_pretrained). "
        f"{meta['batch']} prompts of {meta['prompt_lengths']} tokens ({meta['prompt_tokens']} in all; "
        f"{meta['padded_tokens']} once left-padded), greedy, {meta['new_tokens']} new tokens each, EOS off. "
        "The three runners in one process on its main thread, interleaved run by run, "
        f"{meta['repeats']} runs each after a warm-up run; "
        "decode = steps 2..N (prefill excluded), tok/s = decoded tokens / median decode time, "
        "per-step × = median over steps of transformers' step time / the runner's (same step, same "
        "repeat), ÷ eager_step = decode time / flowmoe eager_step's (median over the runs / best of "
        "the runs), spread = max / min − 1 over the "
        "runs. Agreement is against transformers' tokens.",
        "",
        "| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(cells(r, meta["batch"])) + " |" for r in rows]
    failed = {r["dtype"]: r["failed_runs"] for r in rows if r.get("failed_runs")}
    lines += [f"\n{dtype}: {len(f)} run(s) failed and are left out: {f[0]}" for dtype, f in failed.items()]
    lines += [f"\nNo row: {failure}" for failure in meta.get("failed", [])]
    lines += ["", NOTES.strip()]
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(lines).rstrip("\n") + "\n"
    pattern = re.compile(re.escape(SECTION) + r"\n.*?(?=\n## |\Z)", re.S)
    old = pattern.search(text)
    if old is not None:  # its ### subsections (findings written by hand) stay, after the new table
        kept = re.findall(r"\n(### .*?)(?=\n### |\Z)", old.group(0), re.S)
        block += "".join(f"\n{sub.rstrip()}\n" for sub in kept)
    text = pattern.sub(lambda _: block, text) if old is not None else text.rstrip("\n") + "\n\n" + block
    _write_atomic(path, text.rstrip("\n") + "\n")


def _write_atomic(path: Path, text: str) -> None:
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(temp, path)


def main() -> None:
    args = arguments()
    if args.from_json:
        saved = json.loads((HERE / "vs_transformers.json").read_text())
        console.print(table(saved["rows"], saved["meta"]))
        write_results(HERE / "RESULTS.md", saved["rows"], saved["meta"])
        return
    import transformers

    plan = host_plan(torch.device("cpu"))
    set_intra_op(plan.intra_op)  # this (main) thread runs all three, as `flowmoe run` would
    batch = prompts(args)
    meta = {
        "machine": _machine(), "torch": torch.__version__, "transformers": transformers.__version__,
        "command": " --quick" if args.quick else "",
        "threads": f"{plan.intra_op} torch threads ({usable_cores()} usable cores, default plan), "
                   "main thread",
        "load_before": _load(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "prompt_lengths": args.prompt_lengths.replace(":", "–"),
        "prompt_tokens": sum(map(len, batch)), "padded_tokens": len(batch) * max(map(len, batch)),
        "model": f"Mixtral-shaped, hidden {args.hidden}, intermediate {args.intermediate}, "
                 f"{args.layers} layers, {args.experts} experts top-{args.top_k}, vocab {args.vocab}",
    }  # fmt: skip
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or Path(tmp)
        if not (folder / "config.json").exists():
            console.print(f"writing the checkpoint ({meta['model']})")
            write_checkpoint(args, folder)
        for dtype in args.dtypes.split(","):
            console.print(f"[bold]{dtype}[/], {meta['threads']}")
            try:
                rows += bench_dtype(args, folder, dtype, plan.intra_op)
            except RuntimeError as exc:  # the other dtypes' rows are still written
                console.print(f"[red]{exc}[/]")
                meta.setdefault("failed", []).append(str(exc))
    meta["load_after"] = _load()
    console.print(table(rows, meta))
    if not args.no_write:
        _write_atomic(
            HERE / "vs_transformers.json", json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
        )
        write_results(HERE / "RESULTS.md", rows, meta)


def _machine() -> str:
    flags = cpuinfo_field("flags").split()
    simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    name = cpuinfo_field("model name") or platform.machine()
    return f"{usable_cores()}-vCPU VM, shared ({name}; {', '.join(simd)})"


def _load() -> str:
    return " ".join(f"{n:.1f}" for n in os.getloadavg())


if __name__ == "__main__":
    main()
