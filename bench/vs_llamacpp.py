"""flowmoe against llama.cpp on the CPU: one checkpoint, the same token ids, greedy (issue 25).

A Mixtral-architecture checkpoint with random weights (hidden 1024, intermediate 3584, 8 layers,
8 experts top-2, vocab 32000, 32 heads, 8 KV heads: 791M parameters, the issue's) is written once by
transformers' save_pretrained, with a tokenizer made offline (a byte-fallback BPE tokenizer.json of
the vocab's 32000 entries, which llama.cpp's converter reads as a Llama vocabulary), and converted
to GGUF (f32 and bf16) by convert_hf_to_gguf.py from the llama.cpp source tree that
llama-cpp-python's sdist vendors. llama-cpp-python is built once from PyPI
(CMAKE_ARGS=-DGGML_NATIVE=ON, i.e. -march=native) into a venv outside the repository
(~/.cache/flowmoe-bench/llamacpp-venv, or --cache).

Each measurement runs in a subprocess of its own (one tool, one dtype, one repeat; every batch and
thread count in it), so its peak RSS (ru_maxrss) is that tool's alone; the tools alternate repeat
by repeat. A cell: --batch prompts of --prompt tokens (the same random ids for both tools) prefilled
in one step, then --new-tokens greedy tokens, one decode step each; each tool runs the cell twice
(llama.cpp's memory cleared between, flowmoe's engine making its caches anew) and the second pass
is measured: a batch job's steady state, after its first prompt has made whatever a tool makes
once (oneDNN's GEMM kernels for flowmoe's bf16 prefill, JIT-compiled per shape; llama.cpp's compute
graph); the first pass's prefill is kept beside it ("first prefill"). flowmoe runs the path
`flowmoe run` builds (Runtime.create with the eager scheduler and a default Policy, driven by the
Engine); llama.cpp runs llama_decode through llama-cpp-python's low-level API (one sequence per
prompt, n_seq_max = batch). Per step: wall time and the process's CPU time (user + system, all its
threads): on a machine shared with other work, CPU time per step is the figure that compares;
the load average is noted for each cell. Medians over the repeats, spread = max / min - 1; beside
them the paired ratio: each repeat's flowmoe step against the other tool's run of the same repeat
(the two ran one after the other), the median of those ratios.

Placement and episodes: on the 2-vCPU AMD EPYC VMs of issue 25 the memory speed a 2-thread step
meets moves with the host: flowmoe's GEMV kernel read 220 MB buffers of bf16 weights at 30-36 GB/s
most of the time and at 56-60 GB/s in episodes, every buffer of a process at once
(bench/memory_placement.py; 1 thread: 28-30), and flowmoe's 2-thread bf16 b1 decode step took
14.0-22.5 ms across one grid's 7 repeats (bench/vs_llamacpp_zen4_b1_best.json). flowmoe copies
its weights into memory it allocates in every process; llama.cpp maps its GGUF, whose page-cache
pages stayed the same from one repeat to the next (those the converter wrote), so each llama.cpp
worker first drops them (posix_fadvise DONTNEED; no root needed) and maps pages read afresh, as
flowmoe's are. Beside the medians each tool's fastest repeat is shown ("best"): where both met the
machine at its fastest, the figure that compares them.

    python bench/vs_llamacpp.py                 # fp32 and bf16, batch 1 and 8, 1 and all threads
    python bench/vs_llamacpp.py --quick         # a small model, printed only: checks the script
    python bench/vs_llamacpp.py --from-json     # the table of the last run
    python bench/vs_llamacpp.py --threads 1 --out /tmp/part.json   # a part of the grid, kept apart
    python bench/vs_llamacpp.py --formats int8,int4 --threads 1      # quantized experts (issue 26)

--formats: flowmoe with `--expert-format int8` (int4) against llama.cpp Q8_0 (Q4_0) on the same
checkpoint: the flowmoe model loaded in --quant-dtype (bf16) with its routed experts quantized on
load, the GGUF converted to Q8_0 by the converter (--outtype q8_0) and to Q4_0 by llama.cpp's
llama_model_quantize from the f32 GGUF (its default mix for the type). That `llama.cpp` row
quantizes the attention, embedding and output weights too (the table's `weights` column, read from
the GGUF), flowmoe the routed experts only; the `llama.cpp experts` row is like for like: a GGUF
quantized by llama_model_quantize from the f32 one with the same type for the routed experts and
the attention projections, token embeddings and output in bf16 (its tt_overrides,
token_embedding_type and output_tensor_type; the router and norms stay f32, as llama.cpp keeps
them). A further tool, `flowmoe-torch`, is flowmoe at the same commit with the packed CPU kernels
bypassed (each expert dequantized in torch per call: the path before them); `flowmoe all` quantizes
its attention projections and LM head as well (--attention-format, --lm-head-format: packed, computed by
the packed kernels), and the `llama.cpp` row's ratios are against it (like for like), the others'
against `flowmoe`.
Saved to bench/vs_llamacpp_quant.json unless --out says otherwise.

It runs outside CI: the first build of llama-cpp-python takes minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "flowmoe-bench"
LLAMA_CPP_VERSION = "0.3.36"  # the version issue 25 measured with
TOOLS = ("flowmoe", "llama.cpp")
# flowmoe-torch: the packed kernels bypassed; flowmoe all: its attention projections and LM head quantized
# too (--attention-format, --lm-head-format); llama.cpp experts: its routed experts alone quantized
QUANT_TOOLS = ("flowmoe", "flowmoe-torch", "flowmoe all", "llama.cpp", "llama.cpp experts")
# the flowmoe row each tool's row is compared with: like for like in what each quantized
AGAINST = {"llama.cpp": "flowmoe all"}
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=128, help="tokens per prompt (issue 25: 128)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--formats", default="", help="int8,int4: quantized experts against Q8_0 / Q4_0")
    parser.add_argument("--quant-dtype", default="bfloat16", help="flowmoe's dtype beside --formats")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE, help="the llama.cpp venv, checkpoint and GGUFs")
    parser.add_argument("--quick", action="store_true", help="a small model, 1 repeat (checks the script)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the run is saved (a part run: elsewhere)",
    )
    parser.add_argument("--from-json", action="store_true", help="print the last run's table only")
    parser.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)  # one measuring subprocess
    parser.add_argument("--job", help=argparse.SUPPRESS)  # its job, as JSON
    args = parser.parse_args()
    if args.out is None:
        args.out = HERE / ("vs_llamacpp_quant.json" if args.formats else "vs_llamacpp.json")
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab, args.heads, args.kv_heads = (
            256,
            512,
            2,
            1000,
            4,
            2,
        )
        args.prompt, args.new_tokens, args.repeats = 16, 4, 1
    return args


# ---- what both workers do, and report


def peak_rss() -> int:
    """This process's peak resident set, bytes (VmHWM: ru_maxrss would count the parent's resident set
    at the fork)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


class Clock:
    """A run's step boundaries, in wall and process CPU time (every thread's user + system)."""

    def __init__(self) -> None:
        self.marks = [(time.perf_counter(), time.process_time())]

    def tick(self) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    def steps(self) -> list[tuple[float, float]]:
        """(wall s, CPU s) of each step."""
        return [(w1 - w0, c1 - c0) for (w0, c0), (w1, c1) in zip(self.marks, self.marks[1:], strict=False)]


def cell_result(batch: int, threads: int, first: tuple[float, float], steps: list[tuple[float, float]],
                tokens: list[list[int]], load: float) -> dict:  # fmt: skip
    """first: the first pass's prefill step; steps: the measured pass's prefill step, then one per
    further token."""
    return {
        "batch": batch, "threads": threads, "first_prefill_wall_s": first[0], "first_prefill_cpu_s": first[1],
        "prefill_wall_s": steps[0][0], "prefill_cpu_s": steps[0][1],
        "decode_wall_s": [w for w, _ in steps[1:]], "decode_cpu_s": [c for _, c in steps[1:]],
        "tokens": tokens, "load_before": load, "load_after": os.getloadavg()[0],
    }  # fmt: skip


# ---- llama.cpp (runs in the llama-cpp-python venv: the standard library, numpy and llama_cpp only)


def llamacpp_worker(job: dict) -> dict:
    import llama_cpp as L

    quiet = L.llama_log_callback(lambda *_: None)  # kept alive while llama.cpp may call it
    L.llama_log_set(quiet, None)
    L.llama_backend_init()
    drop_cached(job["model"])
    model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cells = []
    for batch, threads in job["cells"]:
        prompts = job["prompts"][:batch]
        tokens = sum(len(p) for p in prompts)
        params = L.llama_context_default_params()
        params.n_ctx = batch * 256 * -(-(job["prompt"] + job["new_tokens"]) // 256)
        params.n_batch = max(tokens, 512)  # the whole prefill in one llama_decode (n_ubatch: its default)
        params.n_seq_max = batch  # one sequence per prompt
        params.n_threads = params.n_threads_batch = threads
        llama = Llama(L, L.llama_init_from_model(model, params), L.llama_batch_init(tokens, 0, batch), vocab)
        first = llama.generate(prompts, job["new_tokens"], Clock())[1].steps()[0]
        llama.clear()
        load = os.getloadavg()[0]
        out, clock = llama.generate(prompts, job["new_tokens"], Clock())
        cells.append(cell_result(batch, threads, first, clock.steps(), out, load))
        llama.close()
    L.llama_model_free(model)
    return {"cells": cells, "peak_rss": peak_rss(), "system": L.llama_print_system_info().decode()}


def drop_cached(path: str) -> None:
    """Let go of the page cache's copy of `path` (clean pages no process maps), so that llama.cpp's
    mmap of it is given fresh pages, as flowmoe's copy of its weights is in every process (see the
    module's notes on placement)."""
    with open(path, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


class Llama:
    """A llama.cpp context and its batch: greedy next tokens, one llama_decode per step."""

    def __init__(self, lib, ctx, batch, vocab: int) -> None:
        self.lib, self.ctx, self.batch, self.vocab = lib, ctx, batch, vocab

    def decode(self, rows: list[list[int]], start: list[int]) -> list[int]:
        """Sequence s's tokens `rows[s]` at positions start[s]...; the argmax of each one's last logits."""
        import numpy as np

        b, n, last = self.batch, 0, []
        for seq, (row, pos) in enumerate(zip(rows, start, strict=True)):
            for i, token in enumerate(row):
                b.token[n], b.pos[n], b.n_seq_id[n], b.seq_id[n][0] = token, pos + i, 1, seq
                b.logits[n] = i == len(row) - 1
                n += 1
            last.append(n - 1)
        b.n_tokens = n
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        logits = (self.lib.llama_get_logits_ith(self.ctx, i) for i in last)
        return [int(np.ctypeslib.as_array(row, (self.vocab,)).argmax()) for row in logits]

    def generate(self, prompts: list[list[int]], new: int, clock: Clock) -> tuple[list[list[int]], Clock]:
        """Greedy `new` tokens for each prompt from position 0, a tick of `clock` after each step."""
        out = [[t] for t in self.decode(prompts, [0] * len(prompts))]
        clock.tick()
        for step in range(1, new):
            nexts = self.decode([[r[-1]] for r in out], [len(p) + step - 1 for p in prompts])
            for row, token in zip(out, nexts, strict=True):
                row.append(token)
            clock.tick()
        return out, clock

    def clear(self) -> None:
        """Forget every sequence (the next pass starts at position 0 again)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


# ---- flowmoe (runs in the project's venv)


def flowmoe_worker(job: dict) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from flowmoe.core.threads import omp_waits

    omp_waits()  # as `flowmoe run` does, before torch is imported
    from attrs import evolve

    from bench.vs_transformers import flowmoe_generate
    from flowmoe.core.policy import Policy
    from flowmoe.model.loading import Packing, load_model
    from flowmoe.runtime.runner import Runtime
    from flowmoe.schedulers.registry import default_name

    form, dense = job.get("expert_format", "native"), job.get("dense_format", "native")
    # as `flowmoe run --expert-format [--attention-format --lm-head-format]` loads: quantized as read
    packing = Packing(expert_format=form, attention_format=dense, lm_head_format=dense)
    model = load_model(job["model"], job["dtype"], packing=packing)
    if job.get("torch_dequantize"):  # the path before the packed kernels: each expert dequantized in torch
        import flowmoe.model.moe_model as moe_model

        moe_model.packed_routed = moe_model.packed_scaled = lambda *_: None
    cells = []
    for batch, threads in job["cells"]:
        policy = evolve(Policy(), cpu_threads=threads, expert_format=form)
        # what `flowmoe run` runs on a host without a GPU
        runtime = Runtime.create(model, default_name(cuda=False), policy, "cpu", record=False)
        try:
            # a run's ticks: each step's first call of the step runner; the first mark is before setup
            first = Clock()
            flowmoe_generate(model, runtime, job["prompts"][:batch], job["new_tokens"], first)
            load = os.getloadavg()[0]
            before = team_runs(runtime)
            clock = Clock()
            out = flowmoe_generate(model, runtime, job["prompts"][:batch], job["new_tokens"], clock)
            steps = clock.steps()[1 : job["new_tokens"] + 1]
            cell = cell_result(batch, threads, first.steps()[1], steps, out, load)
            cell["team_runs"] = {str(k): v for k, v in (team_runs(runtime) - before).items()}
            cells.append(cell)
        finally:
            runtime.close()
    return {"cells": cells, "peak_rss": peak_rss()}


def team_runs(runtime: Any) -> Counter[int]:
    """The runtime's inline queue runs so far by the OpenMP team width they ran with (a team asked for
    several threads narrows where co-tenants keep a core busy: core/threads.py CoTenants)."""
    runs: Counter[int] = Counter()
    for worker in {id(w): w for w in runtime.workers.values()}.values():
        runs.update(getattr(worker, "team_runs", {}))
    return runs


def threads_ran(threads: int, cells: list[dict]) -> str:
    """`threads`, and where flowmoe's team ran narrower in part of the queue runs, how often."""
    runs: Counter[int] = Counter()
    for cell in cells:
        runs.update({int(k): v for k, v in cell.get("team_runs", {}).items()})
    narrower = sum(v for k, v in runs.items() if k < threads)
    return f"{threads} ({narrower / sum(runs.values()):.0%} narrower)" if narrower else str(threads)


# ---- setup: llama-cpp-python, the checkpoint and its GGUFs


def llamacpp_python(cache: Path) -> Path:
    """The venv's python with llama-cpp-python built for this CPU (built once: minutes)."""
    venv = cache / "llamacpp-venv"
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    ):
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = os.environ | {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}  # -march=native, as a user building it here gets
    subprocess.run(
        [python, "-m", "pip", "install", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env
    )
    return python


def converter(cache: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from the sdist llama-cpp-python vendors it in."""
    tree = cache / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").exists():
        sdist = cache / "sdist"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(sdist)], check=True,
        )  # fmt: skip
        (cache / "src").mkdir(parents=True, exist_ok=True)
        archive = sdist / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
        subprocess.run(["tar", "-xzf", str(archive), "-C", str(cache / "src")], check=True)
    return tree / "convert_hf_to_gguf.py"


def gguf(args: argparse.Namespace, folder: Path, dtype: str) -> Path:
    """The checkpoint converted by llama.cpp's own converter (its tokenizer reading needs sentencepiece,
    installed beside it; gguf-py from the same tree); Q4_0, which the converter does not write, by
    llama.cpp's llama_model_quantize from the f32 GGUF."""
    out = folder.with_name(f"{folder.name}-{GGUF_TYPES[dtype]}.gguf")
    if out.exists():
        return out
    if dtype == "int4":
        quantize_gguf(llamacpp_python(args.cache), gguf(args, folder, "float32"), out, dtype, False)
        return out
    script = converter(args.cache)
    deps = args.cache / "convert-deps"
    if not (deps / "sentencepiece").exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--target", str(deps), "sentencepiece"], check=True
        )
    env = os.environ | {"PYTHONPATH": f"{script.parent / 'gguf-py'}:{deps}"}
    command = [
        sys.executable,
        str(script),
        str(folder),
        "--outtype",
        GGUF_TYPES[dtype],
        "--outfile",
        str(out),
    ]
    subprocess.run(command, check=True, env=env, capture_output=True)
    return out


QUANTIZE = r"""
import ctypes, sys
import llama_cpp as L
BF16 = 30  # GGML_TYPE_BF16 (ggml.h's enum ggml_type; llama-cpp-python names no constant for it)
params = L.llama_model_quantize_default_params()
params.ftype = getattr(L, sys.argv[3])
if sys.argv[4] == "experts":  # all but the routed experts in bf16, as flowmoe holds them
    params.output_tensor_type = params.token_embedding_type = BF16
    overrides = (L.llama_model_tensor_override * 2)((rb"attn_(q|k|v|output)\.weight", BF16), (None, 0))
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(L.llama_model_tensor_override))
if L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    sys.exit("llama_model_quantize failed")
"""
FTYPES = {"int8": "LLAMA_FTYPE_MOSTLY_Q8_0", "int4": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantize_gguf(python: Path, source: Path, out: Path, kind: str, experts_only: bool) -> None:
    """`source` quantized to `kind`'s type by llama.cpp, in the llama.cpp venv: its default mix for
    the type, or (experts_only) the routed experts alone, the rest in bf16 (QUANTIZE)."""
    partial = out.with_suffix(".partial")
    command = [str(python), "-c", QUANTIZE, str(source), str(partial), FTYPES[kind], "experts" * experts_only]
    subprocess.run(command, check=True, capture_output=True)
    partial.rename(out)


def experts_gguf(args: argparse.Namespace, folder: Path, kind: str) -> Path:
    """The checkpoint quantized by llama.cpp as flowmoe's --expert-format `kind` does: the routed
    experts alone (QUANTIZE), from the f32 GGUF."""
    out = folder.with_name(f"{folder.name}-{GGUF_TYPES[kind]}-experts.gguf")
    if not out.exists():
        quantize_gguf(llamacpp_python(args.cache), gguf(args, folder, "float32"), out, kind, True)
    return out


def gguf_weights(args: argparse.Namespace, path: Path) -> str:
    """What a GGUF holds, by tensor type: "Q4_0 57, Q6_K 1, F32 33" (by gguf-py from the converter's tree)."""
    sys.path.insert(0, str(converter(args.cache).parent / "gguf-py"))
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items(), key=lambda item: -item[1]))


def write_checkpoint(args: argparse.Namespace, folder: Path) -> None:
    """The Mixtral-architecture fp32 checkpoint with random weights, and its offline tokenizer."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    write_tokenizer(folder, args.vocab)


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A Llama-style byte-fallback BPE tokenizer of exactly `vocab` entries (<unk> <s> </s>, the 256
    byte tokens, then single characters and filler pieces; no merges): what the converter needs to
    write a Llama vocabulary. The benchmark feeds token ids, so its text quality does not matter."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    chars = [chr(c) for c in range(0x21, 0x7F)] + ["▁"]
    pieces += chars + [f"▁w{i}" for i in range(vocab - len(pieces) - len(chars))]
    bpe = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>"
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.save_pretrained(folder)


# ---- the comparison


def run_worker(python: Path | str, tool: str, job: dict) -> dict:
    command = [str(python), str(Path(__file__).resolve()), "--worker", tool, "--job", json.dumps(job)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tool} worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1 if min(values) > 0 else float("nan")


def rows_from(runs: dict[tuple[str, str], list[dict]], prompt: int) -> list[dict]:
    """One row per (dtype, batch, threads, tool): medians over the repeats."""
    rows = []
    for (dtype, tool), repeats in runs.items():
        for index, first in enumerate(repeats[0]["cells"]):
            cells = [r["cells"][index] for r in repeats]
            batch, threads = first["batch"], first["threads"]
            decode_steps = len(first["decode_wall_s"])
            decode_wall = [sum(c["decode_wall_s"]) for c in cells]
            decode_cpu = [sum(c["decode_cpu_s"]) for c in cells]
            rows.append({
                "dtype": dtype, "tool": tool, "batch": batch, "threads": threads,
                "threads_ran": threads_ran(threads, cells),
                "first_prefill_tok_s": statistics.median(batch * prompt / c["first_prefill_wall_s"]
                                                         for c in cells),
                "prefill_tok_s": statistics.median(batch * prompt / c["prefill_wall_s"] for c in cells),
                "prefill_cpu_s": statistics.median(c["prefill_cpu_s"] for c in cells),
                "prefill_spread": spread([c["prefill_wall_s"] for c in cells]),
                "decode_tok_s": statistics.median(batch * decode_steps / w for w in decode_wall),
                "decode_cpu_ms_step": statistics.median(1e3 * c / decode_steps for c in decode_cpu),
                "decode_wall_ms_step": statistics.median(1e3 * w / decode_steps for w in decode_wall),
                "decode_best_ms_step": 1e3 * min(decode_wall) / decode_steps,
                # each repeat's ms/step (CPU, wall), in the order the repeats ran: the paired ratios
                "decode_cpu_ms_repeats": [1e3 * c / decode_steps for c in decode_cpu],
                "decode_wall_ms_repeats": [1e3 * w / decode_steps for w in decode_wall],
                "decode_spread": spread(decode_wall),
                "peak_rss_gib": statistics.median(r["peak_rss"] for r in repeats) / 2**30,
                "load": [round(c["load_before"], 1) for c in cells] + [round(cells[-1]["load_after"], 1)],
                "tokens": first["tokens"],
            })  # fmt: skip
    flowmoe = {
        (r["tool"], r["dtype"], r["batch"], r["threads"]): r for r in rows if r["tool"].startswith("flowmoe")
    }
    for row in rows:
        against = AGAINST.get(row["tool"], "flowmoe")
        if (against, row["dtype"], row["batch"], row["threads"]) not in flowmoe:
            against = "flowmoe"
        row["against"] = against
        ours = flowmoe[(against, row["dtype"], row["batch"], row["threads"])]
        # flowmoe's speed over this row's tool's, by CPU time per step (> 1: flowmoe ahead)
        row["decode_cpu_ratio"] = row["decode_cpu_ms_step"] / ours["decode_cpu_ms_step"]
        # by wall time too: at several threads CPU time also counts the threads' spin-waits
        row["decode_wall_ratio"] = row["decode_wall_ms_step"] / ours["decode_wall_ms_step"]
        # each tool's fastest repeat: the machine's memory speed moves between repeats (see Placement)
        row["decode_best_ratio"] = row["decode_best_ms_step"] / ours["decode_best_ms_step"]
        # repeat by repeat, each against the run of `against` beside it in time (the tools alternate
        # within a repeat): the median of those ratios, which a slow episode lasting a repeat moves
        # in one pair only, where it moves one tool's median and not the other's
        for kind in ("cpu", "wall"):
            pairs = zip(row[f"decode_{kind}_ms_repeats"], ours[f"decode_{kind}_ms_repeats"], strict=True)
            row[f"decode_paired_{kind}_ratio"] = statistics.median(theirs / mine for theirs, mine in pairs)
        row["prefill_cpu_ratio"] = row["prefill_cpu_s"] / ours["prefill_cpu_s"]
        row["agreement"] = agreement(ours["tokens"], row["tokens"])
    return sorted(rows, key=lambda r: (r["dtype"], r["batch"], r["threads"], r["tool"]))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of tokens equal up to each sequence's first difference."""
    agreed = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(ours, theirs, strict=True))  # fmt: skip
    return agreed / sum(len(x) for x in ours)


COLUMNS = (
    ("dtype", "{dtype}"), ("batch", "{batch}"), ("threads", "{threads_ran}"), ("tool", "{tool}"),
    ("first prefill tok/s", "{first_prefill_tok_s:.1f}"), ("prefill tok/s", "{prefill_tok_s:.1f}"),
    ("prefill CPU s", "{prefill_cpu_s:.2f}"),
    ("decode tok/s", "{decode_tok_s:.2f}"), ("decode ms/step", "{decode_wall_ms_step:.0f}"),
    ("decode CPU ms/step", "{decode_cpu_ms_step:.0f}"),
    ("decode: flowmoe ÷ this, by CPU/step", "{decode_cpu_ratio:.2f}"),
    ("decode: flowmoe ÷ this, by wall/step", "{decode_wall_ratio:.2f}"),
    ("decode best ms/step", "{decode_best_ms_step:.0f}"),
    ("decode: flowmoe ÷ this, best wall/step", "{decode_best_ratio:.2f}"),
    ("decode: flowmoe ÷ this, paired repeats CPU / wall",
     "{decode_paired_cpu_ratio:.2f} / {decode_paired_wall_ratio:.2f}"),
    ("prefill: flowmoe ÷ this, by CPU", "{prefill_cpu_ratio:.2f}"),
    ("spread (prefill / decode)", "{prefill_spread:.0%} / {decode_spread:.0%}"),
    ("peak RSS GiB", "{peak_rss_gib:.2f}"), ("tokens = flowmoe's", "{agreement:.0%}"), ("load avg", "{load}"),
)  # fmt: skip


def columns(rows: list[dict]) -> tuple[tuple[str, str], ...]:
    """COLUMNS, with what each tool quantized after the tool where the rows say (--formats)."""
    if not any("weights" in row for row in rows):
        return COLUMNS
    return (*COLUMNS[:4], ("weights", "{weights}"), ("ratios against", "{against}"), *COLUMNS[4:])


def cells(row: dict, shown: tuple[tuple[str, str], ...]) -> list[str]:
    # older files: nan, flowmoe, the threads asked for, no first pass
    defaults = {"decode_wall_ratio": math.nan, "against": "flowmoe", "threads_ran": row["threads"]}
    defaults |= {"decode_best_ms_step": math.nan, "decode_best_ratio": math.nan}
    defaults |= {"decode_paired_cpu_ratio": math.nan, "decode_paired_wall_ratio": math.nan}
    known = defaults | {"first_prefill_tok_s": math.nan} | row
    return [form.format(**known) for _, form in shown]


def report(saved: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    meta = saved["meta"]
    shown = columns(saved["rows"])
    table = Table(title=f"flowmoe vs llama.cpp — {meta['model']} — {meta['machine']}")
    for title, _ in shown:
        table.add_column(title, justify="left" if title in ("dtype", "tool", "weights") else "right")
    for row in saved["rows"]:
        table.add_row(*cells(row, shown))
    console = Console(width=250)
    console.print(table)
    console.print(
        f"weights: {meta['weights_gib']:.3f} GiB fp32; {meta['repeats']} repeats, tools alternated; "
        f"{meta['date']}"
    )
    print("| " + " | ".join(t for t, _ in shown) + " |\n|" + "---|" * len(shown))
    for row in saved["rows"]:
        print("| " + " | ".join(cells(row, shown)) + " |")


def machine() -> dict:
    # here, not at the top: the llama.cpp worker runs this file in a venv without flowmoe
    from flowmoe.kernels.native import cpuinfo_field

    flags = cpuinfo_field("flags").split()
    simd = [
        f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags
    ]
    return {"cpu": cpuinfo_field("model name"), "simd": simd, "cores": len(os.sched_getaffinity(0))}


def main() -> None:
    args = arguments()
    if args.worker:
        job = json.loads(args.job)
        print(json.dumps((flowmoe_worker if args.worker == "flowmoe" else llamacpp_worker)(job)))
        return
    out = args.out
    if args.from_json:
        report(json.loads(out.read_text()))
        return
    python = llamacpp_python(args.cache)
    name = f"mixtral-h{args.hidden}-i{args.intermediate}-l{args.layers}-e{args.experts}-v{args.vocab}"
    folder = args.cache / name
    if not (folder / "config.json").exists():
        write_checkpoint(args, folder)
    kinds = args.formats.split(",") if args.formats else args.dtypes.split(",")  # the rows' "dtype"
    tools = QUANT_TOOLS if args.formats else TOOLS
    ggufs = {(kind, "llama.cpp"): gguf(args, folder, kind) for kind in kinds}
    if args.formats:
        ggufs |= {(kind, "llama.cpp experts"): experts_gguf(args, folder, kind) for kind in kinds}
    rng = random.Random(1)
    batches, threads = [int(b) for b in args.batches.split(",")], [int(t) for t in args.threads.split(",")]
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt)] for _ in range(max(batches))]
    grid = [(b, t) for b in batches for t in threads]
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for kind in kinds:
            order = tools if repeat % 2 == 0 else tools[::-1]  # alternated, so a load change hits all
            for tool in order:
                ours = tool.startswith("flowmoe")
                model = str(folder) if ours else str(ggufs[(kind, tool)])
                dtype = args.quant_dtype if args.formats else kind
                job = {"model": model, "dtype": dtype, "prompts": prompts, "cells": grid,
                       "prompt": args.prompt, "new_tokens": args.new_tokens}  # fmt: skip
                if args.formats and ours:
                    job |= {"expert_format": kind, "torch_dequantize": tool == "flowmoe-torch",
                            "dense_format": kind if tool == "flowmoe all" else "native"}  # fmt: skip
                worker = (sys.executable, "flowmoe") if ours else (python, "llama.cpp")
                result = run_worker(*worker, job)
                runs.setdefault((kind, tool), []).append(result)
                print(
                    f"repeat {repeat} {kind} {tool}: peak RSS {result['peak_rss'] / 2**30:.2f} GiB",
                    flush=True,
                )
    system = next(r["system"] for (_, tool), rs in runs.items() if tool.startswith("llama.cpp") for r in rs)
    meta = {
        "model": f"Mixtral architecture, hidden {args.hidden}, intermediate {args.intermediate}, "
                 f"{args.layers} "
                 f"layers, {args.experts} experts top-{args.top_k}, vocab {args.vocab}, random weights",
        "machine": machine(), "llama_cpp_python": LLAMA_CPP_VERSION, "llama_cpp_system": system,
        "weights_gib": sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30,
        "repeats": args.repeats, "prompt": args.prompt, "new_tokens": args.new_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    rows = rows_from(runs, args.prompt)
    if args.formats:  # what each tool quantized: flowmoe the routed experts, llama.cpp (nearly) every matrix
        held = {key: gguf_weights(args, path) for key, path in ggufs.items()}
        for row in rows:
            dense = GGUF_TYPES[args.quant_dtype]
            mine = f"{row['dtype']} experts, attention and LM head" if row["tool"] == "flowmoe all" else None
            row["weights"] = held.get(
                (row["dtype"], row["tool"]), mine or f"{row['dtype']} experts, {dense} rest"
            )
        meta["model"] += f"; flowmoe in {args.quant_dtype} with its routed experts quantized on load"
    saved = {"meta": meta, "rows": rows}
    if not args.quick:  # a check of the script: printed only
        out.write_text(json.dumps(saved, indent=1) + "\n")
    report(saved)


if __name__ == "__main__":
    main()
