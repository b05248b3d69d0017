"""flowmoe against transformers' `generate` on the CPU: same checkpoint, prompts and batch, greedy.

A Mixtral-shaped checkpoint with random weights (hidden 768, 6 layers, 8 experts top-2, fp32; issue
15) is written once with transformers' save_pretrained; a batch of 16 mixed-length prompts then runs
  * through transformers `generate` (left padding + attention mask, its default experts
    implementation),
  * through `flowmoe run`'s path: the dataflow runtime with the `eager` scheduler and default
    settings (Runtime.create with a default Policy, driven by the Engine, as `flowmoe run` builds
    it; prompts packed without padding), and
  * through flowmoe's plain `eager_step` (the same model code, no runtime),
with default threads (the thread plan's; OMP_NUM_THREADS narrows it), the checkpoint's weights
converted to each --dtypes the same way on both sides.

The three run in lockstep, in one process: one step of each in turn (a baton passes between their
threads at each step boundary), so a load change on a shared machine hits all three alike. A step
of transformers is the time between two tokens its streamer receives; a step of flowmoe the time
between two calls of its step runner (the engine's sampling included on both sides). Decode =
incremental steps 2..N (prefill excluded); end-to-end = every step of the run, prefill included.
Each measured run is repeated (--repeats); best and median of the repeats are reported, with the
run-to-run spread (max / min - 1). Prints a rich table, writes bench/vs_transformers.json and the
`## vs transformers (CPU)` section of bench/RESULTS.md.

    python bench/vs_transformers.py            # fp32 and bf16, 3 repeats (several minutes on 2 cores)
    python bench/vs_transformers.py --quick    # a small model, one dtype, to check the script (< 2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from flowmoe.core.threads import usable_cores
from flowmoe.devices.factory import host_plan
from flowmoe.devices.threadpool import set_intra_op
from flowmoe.jobs.batching import BatchLimits, Request
from flowmoe.jobs.engine import Engine, StepInput, eager_step
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime

HERE = Path(__file__).parent
SECTION = "## vs transformers (CPU)"
NOTES = """
* **Threads** (flowmoe/core/threads.py, docs/architecture.md "Threads on the host"): without CUDA
  the runtime runs every lane's nodes on the event loop's thread with the whole thread budget, so a
  `flowmoe run` step runs the same ops on the same OpenMP team as `eager_step`; before, each lane
  had a thread of its own at every core's worth of OpenMP threads (oversubscribed) and every node
  and routing answer crossed threads. A layer's experts run in one kernel call on both paths
  (actions.py groups the expert nodes bound to one lane).
* **What the runtime still adds over eager_step** (CPU time of the step's thread, one torch
  thread, the two interleaved, load ~15): the model's own methods take the same time on both
  paths; the eager plan's 80 nodes a step cost ~0.4 ms to plan and ~0.6 ms to pass through the
  executor with no-op actions (uvloop; asyncio's loop ~0.75 ms), the actions' bookkeeping ~1.5 ms
  more. On a loaded machine the thread's CPU time outside the model ran 5-11 ms a step (~3-6 %
  of a ~150 ms CPU step), the scatter being the load's.
* **Shared machine.** These figures were taken with other jobs running (load averages in the
  first line): an OpenMP parallel region waits for its second thread whenever another process
  holds the other vCPU, so absolute times and the spread are the load's; the lockstep keeps the
  comparison fair (each step of each runner meets the same load), and the per-step ratio is the
  steadiest figure. `OMP_NUM_THREADS=1` trades the second core for steadier times: one such
  fp32 run at load ~13 (2 runs, 00:30 UTC): transformers 18.1 /
  19.4 s decode, flowmoe run 14.5 / 15.4 s (1.26x), eager_step 13.8 / 14.6 s (1.33x), spread 12 %.
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
    parser.add_argument("--repeats", type=int, default=3, help="lockstep runs per dtype")
    parser.add_argument("--checkpoint", type=Path, help="reuse (or write once into) this folder")
    parser.add_argument("--quick", action="store_true", help="a small model, fp32 only (checks the script)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the JSON and RESULTS.md")
    parser.add_argument("--from-json", action="store_true", help="rewrite RESULTS.md from the last JSON only")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab = 512, 1024, 2, 512
        args.new_tokens, args.prompt_lengths, args.repeats, args.dtypes = 8, "4:24", 2, "float32"
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


class Baton:
    """Turns among runners in a fixed order: one step of each in turn. Each runner's own time is
    the sum of its turns (the time it waited for the others is not counted)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = list(names)
        self._turn = self._order[0]
        self._ready = threading.Condition()
        self.steps: dict[str, list[float]] = {name: [] for name in names}
        self._began: dict[str, float] = {}

    def begin(self, name: str) -> None:
        """Wait for `name`'s first turn."""
        with self._ready:
            self._ready.wait_for(lambda: self._turn == name)
        self._began[name] = time.perf_counter()

    def boundary(self, name: str) -> None:
        """End `name`'s current step, let the others take theirs, then start its next."""
        self.steps[name].append(time.perf_counter() - self._began[name])
        with self._ready:
            self._pass(name)
            self._ready.wait_for(lambda: self._turn == name)
        self._began[name] = time.perf_counter()

    def finish(self, name: str) -> None:
        """`name`'s last step has ended: it leaves the rotation."""
        self.steps[name].append(time.perf_counter() - self._began[name])
        with self._ready:
            self._pass(name)
            self._order.remove(name)

    def _pass(self, name: str) -> None:
        position = self._order.index(name)
        self._turn = self._order[(position + 1) % len(self._order)]
        self._ready.notify_all()


class Streamer:
    """transformers' streamer hook: each token batch it receives is a step boundary."""

    def __init__(self, baton: Baton, name: str) -> None:
        self.baton, self.name = baton, name

    def put(self, value: torch.Tensor) -> None:
        self.baton.boundary(self.name)

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


def flowmoe_generate(model: MoEModel, runner: Runner, batch: list[list[int]], new_tokens: int,
                     baton: Baton | None = None, name: str = "") -> Tokens:  # fmt: skip
    """The whole batch in one micro-batch (`flowmoe run --batch-size 16`), prompts packed without
    padding; every call of the step runner is a step boundary."""
    requests = [Request(str(i), tuple(p), i) for i, p in enumerate(batch)]
    limits = BatchLimits(micro_batches=1, micro_batch_size=len(batch), max_new_tokens=new_tokens)

    async def step(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        if baton is not None:
            baton.boundary(name)
        return await runner(m, inputs)  # type: ignore[misc]

    async def go() -> dict[str, tuple[int, ...]]:
        engine = Engine(model, step, max_new_tokens=new_tokens, stop_ids=frozenset(),
                        cache_device=getattr(runner, "cache_device", torch.device("cpu")))  # fmt: skip
        return {r.id: r.output_ids async for r in engine.generate(requests, limits)}

    out = asyncio.run(go())
    return [list(out[str(i)]) for i in range(len(batch))]


def agreement(ours: Tokens, reference: Tokens) -> tuple[int, float]:
    """(sequences identical, share of tokens equal up to each sequence's first difference)."""
    same, agreed = 0, 0
    for a, b in zip(ours, reference, strict=True):
        same += a == b
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same, agreed / sum(len(r) for r in reference)


def lockstep(
    runs: dict[str, Callable[[Baton, str], Tokens]], threads: int
) -> tuple[Baton, dict[str, Tokens]]:
    """One run of each, step by step in turn, each on a thread of its own with `threads` torch threads."""
    baton = Baton(list(runs))
    tokens: dict[str, Tokens] = {}
    errors: list[BaseException] = []

    def body(name: str, run: Callable[[Baton, str], Tokens]) -> None:
        set_intra_op(threads)
        baton.begin(name)
        try:
            tokens[name] = run(baton, name)
        except BaseException as exc:  # reported after the others have finished
            errors.append(exc)
        finally:
            baton.finish(name)

    workers = [threading.Thread(target=body, args=item, name=item[0]) for item in runs.items()]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return baton, tokens


def bench_dtype(args: argparse.Namespace, folder: Path, dtype: str, threads: int) -> list[dict]:
    """Both sides load the same folder, converting its fp32 weights to `dtype` the same way."""
    from transformers import MixtralForCausalLM

    batch = prompts(args)
    hf = MixtralForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # every run generates exactly --new-tokens tokens
    ours = load_model(folder, dtype)
    runtime = Runtime.create(ours, "eager", record=False)  # `flowmoe run`'s defaults
    new = args.new_tokens
    runs: dict[str, Callable[[Baton, str], Tokens]] = {
        RUNNERS[0]: lambda baton, name: hf_generate(hf, batch, new, Streamer(baton, name)),
        RUNNERS[1]: lambda baton, name: flowmoe_generate(ours, runtime, batch, new, baton, name),
        RUNNERS[2]: lambda baton, name: flowmoe_generate(ours, eager_step, batch, new, baton, name),
    }
    repeats: list[dict[str, list[float]]] = []
    failures: list[str] = []
    try:
        for repeat in range(args.repeats):
            try:
                baton, tokens = lockstep(runs, threads)
            except Exception as exc:  # a run that fails is reported and left out; the others count
                failures.append(f"{type(exc).__name__}: {exc}")
                console.print(f"  repeat {repeat + 1} failed (left out): {failures[-1]}")
                continue
            repeats.append(baton.steps)
            line = ", ".join(f"{n} decode {sum(decode_steps(baton.steps[n], new)):.2f} s" for n in RUNNERS)
            console.print(f"  repeat {repeat + 1}: {line}")
    finally:
        runtime.close()
    if not repeats:
        raise RuntimeError(f"{dtype}: every run failed: {failures[0]}")
    rows = rows_for(args, dtype, threads, repeats, tokens)
    for row in rows:
        row["failed_runs"] = failures
    return rows


def decode_steps(steps: list[float], new_tokens: int) -> list[float]:
    """Incremental decode steps 2..N: a run's turns are its setup, its prefill (token 1), one turn
    per further token, then (transformers) what `generate` does after its last token."""
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
    ("÷ eager_step", "decode_vs_eager_step", "{:.3f}"),
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
        f"The three runners in lockstep (one step of each in turn, one process), {meta['repeats']} runs; "
        "decode = steps 2..N (prefill excluded), tok/s = decoded tokens / median decode time, "
        "per-step × = median over steps of transformers' step time / the runner's (same step, same "
        "run), ÷ eager_step = decode time / flowmoe eager_step's, spread = max / min − 1 over the "
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
    text = pattern.sub(lambda _: block, text) if SECTION in text else text.rstrip("\n") + "\n\n" + block
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
    batch = prompts(args)
    meta = {
        "machine": _machine(), "torch": torch.__version__, "transformers": transformers.__version__,
        "command": " --quick" if args.quick else "",
        "threads": f"{plan.intra_op} torch threads per runner ({usable_cores()} usable cores, default plan)",
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
    flags = _cpuinfo("flags").split()
    simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    name = _cpuinfo("model name") or platform.machine()
    return f"{usable_cores()}-vCPU VM, shared ({name}; {', '.join(simd)})"


def _cpuinfo(field: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _load() -> str:
    return " ".join(f"{n:.1f}" for n in os.getloadavg())


if __name__ == "__main__":
    main()
