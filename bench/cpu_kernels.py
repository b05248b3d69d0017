"""Each CPU kernel as a fraction of the roof that bounds it, all measured in one run.

Roofs: memory read (a sum over a 1 GiB fp32 tensor, far beyond the LLC), copy (read + write
counted, as STREAM does) and compute (a square fp32 / bf16 GEMM), with the thread count
the kernels get (`--threads`, default torch's). The read and copy buffers lie on transparent huge
pages (kernels/host_memory.py), the fastest memory the machine reads; the same read on ordinary
4 KiB pages is kept as "read 4k" for information. Ops at the shapes schedules give them, their
operands allocated as flowmoe allocates them (KV caches by KVCache.allocate, on huge pages; expert
weights by host_memory.huge_copy, as the model's host weights):

* decode attention over a KV cache (Mixtral 8x7B's GQA: 32 query heads, 8 KV heads, head
  dim 128; config.json of mistralai/Mixtral-8x7B-v0.1), batch 1-16, lengths 128-8k;
  bytes = the K and V read. Variants: flowmoe's `attend` (kernels/cpu_attention.c), the same file
  at `--baseline` (the matmul / masked softmax / matmul kernel before issue 15) and at TORCH_PATH
  (torch's flash kernel / matmuls, before cpu_attention.c), and torch's
  F.scaled_dot_product_attention (CPU flash kernel) with enable_gqa (q [B, 32, 1, D]) and with
  each KV group's query heads as query rows (q [B, 8, 4, D]);
* prefill attention (one sequence, causal), FLOP-bound: 4 H D n(n+1)/2 FLOPs;
* expert FFN (SwiGLU gate_up + down) for 1-64 rows: OLMoE-1B-7B's expert (hidden 2048,
  intermediate 1024; allenai/OLMoE-1B-7B-0924 config.json) and, without --quick, Mixtral
  8x7B's (4096 x 14336); bytes = the expert's weights. Variants: `swiglu_ffn`,
  `swiglu_ffn_group` over 8 experts (bytes x 8) and `swiglu_ffn_torch` (torch ops), and where the
  CPU kernels choose another block than the portable one (kernels/cpu_rows_avx2.c with AVX2,
  cpu_rows_avx512.c with AVX-512 + BF16), `swiglu_ffn portable block` (kernels/cpu_expert.c's);
* expert FFN at prefill's rows, FLOP-bound (2 x rows x 3 x hidden x intermediate FLOPs, against the
  GEMM roof): issue 25's checkpoint's expert (hidden 1024, intermediate 3584), 16-128 rows (a
  128-token prefill gives its 8 experts 32 rows each on average), four experts' weights in turn
  (beyond the LLC). Variants: `swiglu_ffn` (the AVX2 block's wide tiles from 16 rows on, or the
  AVX-512 block's, up to cpu_expert.max_rows), `swiglu_ffn_torch` (torch ops; bf16 widened to fp32
  where torch emulates it) and the portable block where the CPU kernels choose another;
* projection (a decode step's few-row linear, bytes = the weight) at issue 25's checkpoint's shapes
  (bench/vs_llamacpp.py: hidden 1024, intermediate 3584, vocab 32000): an expert's gate_up
  [7168, 1024], down [1024, 3584] and the LM head [32000, 1024], 1-8 rows. Variants: `linear_rows`
  (kernels/cpu_expert.py, the block chosen for this CPU), `linear_rows portable block` where that
  differs, and torch's few-row form (w @ x.T).T (kernels/linear.py's path without the kernels).

Caches and weights are cycled through distinct buffers totalling >= 2 GiB (1 GiB with --quick)
so no repetition finds its operands in the last-level cache. Each row interleaves roof samples with the
variants; rates are best-of-N (median also kept). A memory-bound row's roof is the best of
the run's read roof and of its own "read (sum)" variant (a sum over the same operands, so the
roof is sampled in calls as short as the op's: on a loaded machine a short call is likelier
to run undisturbed); a FLOP-bound row's is the run's best GEMM. Prints rich tables, writes
bench/cpu_kernels.json.

On a machine others load, `--threads 1 --clock cpu` times each call by its thread's CPU time
(preemption excluded; other processes still share the memory bus).

    python bench/cpu_kernels.py [--quick] [--threads N] [--baseline REV] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_expert
from flowmoe.kernels.attention import attend
from flowmoe.kernels.experts import swiglu_ffn, swiglu_ffn_group, swiglu_ffn_torch
from flowmoe.kernels.host_memory import huge_copy, huge_zeros
from flowmoe.kernels.kv_cache import KVCache
from flowmoe.kernels.layout import TokenLayout

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "455bf73"  # the last commit of kernels/attention.py before issue 15
TORCH_PATH = "87fd6ff"  # the last kernels/attention.py before cpu_attention.c (torch's kernels)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Mixtral 8x7B
EXPERTS = {"OLMoE-1B-7B": (2048, 1024), "Mixtral-8x7B": (4096, 14336)}  # hidden, intermediate
# issue 25's checkpoint (bench/vs_llamacpp.py's defaults): [out, in] of its decode projections
PROJECTIONS = {
    "gate_up 7168x1024": (7168, 1024),
    "down 1024x3584": (1024, 3584),
    "lm head 32000x1024": (32000, 1024),
}
PORTABLE = "portable"  # cpu_expert's block before the per-CPU choice (kernels/cpu_expert.c)
CYCLE = 2 << 30  # bytes cycled per row, > 4x the 480 MiB LLC lscpu reports here (--quick: 1 GiB, > 2x)
ROOF_BYTES = 1 << 30
CONSOLE = Console()
READ = "read (sum)"  # each row's own roof sample: a sum over the same operands
GROUP = 8  # experts per swiglu_ffn_group call
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> dict:
    """lscpu's model, cores and SIMD / AMX flags."""
    info = {"model": platform.processor(), "cpus": os.cpu_count(), "flags": []}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return info
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    flags = set(fields.get("Flags", "").split())
    info["model"] = fields.get("Model name", "").strip()
    info["flags"] = [f for f in FLAGS if f in flags]
    info["l3"] = fields.get("L3 cache", "").strip()
    return info


def baseline_attend(rev: str) -> Callable | None:
    """`attend` from kernels/attention.py at git revision `rev`, or None outside a git checkout."""
    shown = subprocess.run(
        ["git", "show", f"{rev}:kernels/attention.py"], cwd=ROOT, capture_output=True, text=True
    )
    if shown.returncode != 0:
        return None
    module = types.ModuleType("attention_baseline")
    exec(compile(shown.stdout, f"{rev}:kernels/attention.py", "exec"), module.__dict__)
    return module.attend


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (the calling thread's CPU time, --threads 1)


def timed(fn: Callable[[], object]) -> float:
    started = CLOCK()
    fn()
    return CLOCK() - started


class Roofs:
    """Read / copy / GEMM roofs, sampled between the ops' repetitions; the best sample counts. Read
    and copy on huge pages ("read 4k": the same read on ordinary pages, for information)."""

    def __init__(self, gemm_n: int) -> None:
        self.read_4k = torch.ones(ROOF_BYTES // 4)
        self.read_buf = huge_copy(self.read_4k)
        self.copy_src = huge_copy(torch.ones(ROOF_BYTES // 16))
        self.copy_dst = huge_zeros((ROOF_BYTES // 16,), torch.float32)
        self.gemm = {
            name: (torch.randn(gemm_n, gemm_n).to(dt), torch.randn(gemm_n, gemm_n).to(dt))
            for name, dt in DTYPES.items()
        }
        names = ("read", "read 4k", "copy", "gemm fp32", "gemm bf16")
        self.samples: dict[str, list[float]] = {name: [] for name in names}

    def sample_read(self) -> None:
        self.samples["read"].append(ROOF_BYTES / timed(self.read_buf.sum))
        self.samples["read 4k"].append(ROOF_BYTES / timed(self.read_4k.sum))
        self.samples["copy"].append(
            2 * self.copy_src.nbytes / timed(lambda: self.copy_dst.copy_(self.copy_src))
        )

    def sample_gemm(self, dtype: str) -> None:
        a, b = self.gemm[dtype]
        self.samples[f"gemm {dtype}"].append(2 * a.shape[0] ** 3 / timed(lambda: torch.mm(a, b)))

    def best(self, name: str) -> float:
        return max(self.samples[name])

    def summary(self) -> dict:
        return {
            name: {"best": max(s), "median": statistics.median(s), "samples": len(s)}
            for name, s in self.samples.items()
            if s
        }


def cycled(make: Callable[[], object], nbytes: int) -> list:
    """Enough distinct operand sets of `nbytes` each that together they exceed CYCLE."""
    return [make() for _ in range(max(2, -(-CYCLE // nbytes)))]


def measure(variants: dict[str, Callable], operands: list, repeats: int, roof: Callable[[], None]) -> dict:
    """Interleaved: per repetition one roof sample, then each variant over every operand set in turn
    (so a variant never finds operands the previous one just read still in the cache)."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        roof()
        for name, fn in variants.items():
            seconds[name].extend(timed(lambda fn=fn, ops=ops: fn(*ops)) for ops in operands)
    return {name: {"best_s": min(s), "median_s": statistics.median(s)} for name, s in seconds.items()}


def progress(row: dict) -> dict:
    """Print a measured row (best time per variant) as it completes."""
    times = ", ".join(f"{name} {stats['best_s'] * 1e3:.2f} ms" for name, stats in row["variants"].items())
    CONSOLE.print(f"{row['op']} {row['shape']} {row['dtype']}: {times}", highlight=False)
    return row


def work(row: dict, variant: str) -> float:
    """Bytes or FLOPs of one call of `variant` in `row` (a grouped expert call does GROUP experts)."""
    if "flops" in row:
        return row["flops"]
    return row["bytes"] * (GROUP if variant.startswith("swiglu_ffn_group") else 1)


def rates(row: dict, roofs: Roofs) -> dict:
    """Rates from best / median times; fractions of the run's best roof of the row's bound (all
    samples, taken after every row ran), or of the row's own read of the same operands (READ)
    where that ran faster (a roof sample as short as the op's calls)."""
    for name, stats in row["variants"].items():
        stats["rate"] = work(row, name) / stats["best_s"]
        stats["rate_median"] = work(row, name) / stats["median_s"]
    roof = roofs.best(row["bound"])
    if READ in row["variants"]:
        roof = max(roof, row["variants"][READ]["rate"])
    row["roof"] = roof
    if row["bound"] == "read":  # for information: the best read of the run on 4 KiB pages
        row["roof_4k"] = roofs.best("read 4k")
    for stats in row["variants"].values():
        stats["fraction"] = stats["rate"] / roof
    return row


def kv_cache(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-layer KVCache (as flowmoe allocates it) holding src [B, kvh, L, D] as keys and values."""
    batch, kv_heads, length, dim = src.shape
    cache = KVCache.allocate(1, batch, kv_heads, length, dim, src.dtype)
    keys, values = cache.layer(0)
    return keys.copy_(src), values.copy_(src)


def decode_rows(shapes, roofs: Roofs, repeats: int, before: dict[str, Callable]) -> list[dict]:
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for batch, length, ragged, shuffled in shapes:
            past = [length - 1 - (i * length // (2 * batch) if ragged else 0) for i in range(batch)]
            slots = tuple(reversed(range(batch))) if shuffled else tuple(range(batch))
            layout = TokenLayout(slots, (1,) * batch, tuple(past))
            shape = (batch, KV_HEADS, length, HEAD_DIM)
            src = torch.randn(shape).to(dtype)
            q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
            nbytes = 2 * src.nbytes
            operands = cycled(lambda src=src: kv_cache(src), nbytes)
            read = 2 * sum(p + 1 for p in past) * KV_HEADS * HEAD_DIM * src.element_size()
            variants = {READ: lambda k, v: (k.sum(), v.sum())}
            if ragged:  # only the keys and values the row counts
                ends = [p + 1 for p in past]
                variants[READ] = lambda k, v, ends=ends: [
                    (k[i, :, :end].sum(), v[i, :, :end].sum()) for i, end in enumerate(ends)
                ]
            variants["flowmoe"] = lambda k, v, lay=layout, q=q: attend(q, k, v, lay)
            for name, old in before.items():
                variants[name] = lambda k, v, lay=layout, q=q, old=old: old(q, k, v, lay)
            if not ragged and not shuffled:  # torch's public calls, K/V read per query head or per KV head
                qh = q.reshape(batch, HEADS, 1, HEAD_DIM)
                qg = q.reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
                variants["sdpa gqa"] = lambda k, v, qh=qh: F.scaled_dot_product_attention(
                    qh, k, v, enable_gqa=True
                )
                variants["sdpa grouped"] = lambda k, v, qg=qg: F.scaled_dot_product_attention(qg, k, v)
            label = (
                f"B{batch} L{length}"
                + (" ragged" if ragged else "")
                + (" slots reversed" if shuffled else "")
            )
            row = {
                "op": "decode attention",
                "shape": label,
                "dtype": dtype_name,
                "bytes": read,
                "bound": "read",
                "variants": measure(variants, operands, repeats, roofs.sample_read),
            }
            rows.append(progress(row))
            del operands
    return rows


def prefill_rows(lengths, roofs: Roofs, repeats: int, before: dict[str, Callable]) -> list[dict]:
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for n in lengths:
            keys, values = (torch.randn(1, KV_HEADS, n, HEAD_DIM).to(dtype) for _ in range(2))
            q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
            layout = TokenLayout((0,), (n,), (0,))
            variants = {"flowmoe": lambda lay=layout, q=q, k=keys, v=values: attend(q, k, v, lay)}
            if "before" in before:
                old = before["before"]
                variants["before"] = lambda lay=layout, q=q, k=keys, v=values, old=old: old(q, k, v, lay)
            flops = 4 * HEADS * HEAD_DIM * n * (n + 1) / 2
            row = {
                "op": "prefill attention",
                "shape": f"n{n}",
                "dtype": dtype_name,
                "flops": flops,
                "bound": f"gemm {dtype_name}",
                "variants": measure(variants, [()], repeats, lambda d=dtype_name: roofs.sample_gemm(d)),
            }
            rows.append(progress(row))
    return rows


def expert_rows(experts: dict, row_counts, roofs: Roofs, repeats: int) -> list[dict]:
    rows, group = [], GROUP
    moe = MoESpec(experts=group, top_k=2, intermediate=0)
    for name, (hidden, inter) in experts.items():
        for dtype_name, dtype in DTYPES.items():
            gate_up = torch.randn(2 * inter, hidden).to(dtype) * hidden**-0.5
            down = torch.randn(hidden, inter).to(dtype) * inter**-0.5
            weight_bytes = gate_up.nbytes + down.nbytes
            # one expert each
            sets = cycled(lambda g=gate_up, d=down: (huge_copy(g), huge_copy(d)), weight_bytes)
            for n in row_counts:
                x = torch.randn(n, hidden).to(dtype)
                single = {
                    READ: lambda g, d: (g.sum(), d.sum()),
                    "swiglu_ffn": lambda g, d, x=x: swiglu_ffn(x, g, d, moe),
                    "swiglu_ffn_torch": lambda g, d, x=x: swiglu_ffn_torch(x, (g, d, None, None), moe),
                }
                if _other_block() and cpu_expert.fits_ffn(x, (gate_up, down, None, None)):
                    single[f"swiglu_ffn {PORTABLE} block"] = lambda g, d, x=x: cpu_expert.swiglu_group(
                        [x], [(g, d, None, None)], moe, PORTABLE
                    )
                measured = measure(single, sets, repeats, roofs.sample_read)
                grouped = [
                    [(g, d, None, None) for g, d in sets[i : i + group]]
                    for i in range(0, len(sets) - group + 1, group)
                ]
                if grouped:
                    xs = [x] * group
                    measured |= measure(
                        {f"swiglu_ffn_group x{group}": lambda ffns, xs=xs: swiglu_ffn_group(xs, ffns, moe)},
                        [(ffns,) for ffns in grouped],
                        repeats,
                        roofs.sample_read,
                    )
                row = {
                    "op": "expert FFN",
                    "shape": f"{name} {hidden}x{inter} rows {n}",
                    "dtype": dtype_name,
                    "bytes": weight_bytes,
                    "bound": "read",
                    "variants": measured,
                }
                rows.append(progress(row))
            del sets
    return rows


PREFILL_EXPERT = (1024, 3584)  # issue 25's checkpoint (bench/vs_llamacpp.py's defaults): hidden, intermediate
PREFILL_SETS = 4  # experts' weights cycled per row: 4 x 21 MiB (bf16) > the 32 MiB L3 of the EPYC here


def prefill_expert_rows(row_counts, roofs: Roofs, repeats: int) -> list[dict]:
    rows = []
    moe = MoESpec(experts=GROUP, top_k=2, intermediate=0)
    hidden, inter = PREFILL_EXPERT
    for dtype_name, dtype in DTYPES.items():
        gate_up = torch.randn(2 * inter, hidden).to(dtype) * hidden**-0.5  # [2I, hidden]
        down = torch.randn(hidden, inter).to(dtype) * inter**-0.5  # [hidden, I]
        sets = [(huge_copy(gate_up), huge_copy(down)) for _ in range(PREFILL_SETS)]
        for n in row_counts:
            x = torch.randn(n, hidden).to(dtype)  # [n, hidden]
            variants = {
                "swiglu_ffn": lambda g, d, x=x: swiglu_ffn(x, g, d, moe),
                "swiglu_ffn_torch": lambda g, d, x=x: swiglu_ffn_torch(x, (g, d, None, None), moe),
            }
            if _other_block():
                variants[f"swiglu_ffn {PORTABLE} block"] = lambda g, d, x=x: cpu_expert.swiglu_group(
                    [x], [(g, d, None, None)], moe, PORTABLE
                )
            row = {
                "op": "expert FFN prefill",
                "shape": f"{hidden}x{inter} rows {n}",
                "dtype": dtype_name,
                "flops": 2 * n * 3 * hidden * inter,
                "bound": f"gemm {dtype_name}",
                "variants": measure(variants, sets, repeats, lambda d=dtype_name: roofs.sample_gemm(d)),
            }
            rows.append(progress(row))
        del sets
    return rows


def _other_block() -> bool:
    """Whether the CPU kernels multiply with another block than the portable one here."""
    return cpu_expert.library() is not None and cpu_expert.isa() != PORTABLE


def projection_rows(shapes: dict, row_counts, roofs: Roofs, repeats: int) -> list[dict]:
    rows = []
    for name, (n_out, n_in) in shapes.items():
        for dtype_name, dtype in DTYPES.items():
            weight = torch.randn(n_out, n_in).to(dtype) * n_in**-0.5
            sets = cycled(lambda w=weight: (huge_copy(w),), weight.nbytes)
            for n in row_counts:
                x = torch.randn(n, n_in).to(dtype)
                variants = {
                    READ: lambda w: w.sum(),
                    "torch (w @ x.T).T": lambda w, x=x: torch.matmul(w, x.t()).t(),
                }
                if cpu_expert.fits(x, weight):
                    variants["linear_rows"] = lambda w, x=x: cpu_expert.linear_rows(x, w)
                    if _other_block():
                        variants[f"linear_rows {PORTABLE} block"] = lambda w, x=x: cpu_expert.linear_rows(
                            x, w, None, PORTABLE
                        )
                row = {
                    "op": "projection",
                    "shape": f"{name} rows {n}",
                    "dtype": dtype_name,
                    "bytes": weight.nbytes,
                    "bound": "read",
                    "variants": measure(variants, sets, repeats, roofs.sample_read),
                }
                rows.append(progress(row))
            del sets
    return rows


def table(title: str, rows: list[dict], unit: str, scale: float) -> Table:
    names = list(dict.fromkeys(v for row in rows for v in row["variants"]))
    out = Table(title=title)
    four_k = any("roof_4k" in row for row in rows)
    columns = ("shape", "dtype", f"roof {unit}", *([f"roof 4k {unit}"] if four_k else []))
    for column in (*columns, *[f"{n} {unit} (frac)" for n in names]):
        out.add_column(column, justify="right")
    for row in rows:
        cells = []
        for name in names:
            stats = row["variants"].get(name)
            cells.append(f"{stats['rate'] / scale:.1f} ({stats['fraction']:.0%})" if stats else "-")
        roof = [f"{row['roof'] / scale:.1f}", *([f"{row['roof_4k'] / scale:.1f}"] if four_k else [])]
        out.add_row(row["shape"], row["dtype"], *roof, *cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (< 2 min)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the 'before' attention kernel")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: time each call by its thread's CPU time (needs --threads 1), for a machine others load",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("cpu_kernels.json"))
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu: needs --threads 1 (a thread's CPU time misses the other threads' work)")
    global CLOCK, CYCLE
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    CYCLE = 1 << 30 if args.quick else CYCLE
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    info = machine()
    CONSOLE.print(
        f"{info['model']}, {info['cpus']} CPUs, L3 {info.get('l3', '?')}, flags: {' '.join(info['flags'])}; "
        f"torch {torch.__version__}, {args.threads} threads; load {load_before}"
    )
    repeats = 3 if args.quick else 5
    roofs = Roofs(gemm_n=2048 if args.quick else 4096)
    for _ in range(repeats):
        roofs.sample_read()
        for dtype in DTYPES:
            roofs.sample_gemm(dtype)
    before = {
        name: module
        for name, rev in (("before", args.baseline), ("torch path", TORCH_PATH))
        if (module := baseline_attend(rev)) is not None
    }
    if args.quick:
        decode = [(1, 2048, False, False), (16, 512, False, False), (4, 8192, False, False)]
        prefill, counts, experts = (512,), (1, 4, 16, 64), {"OLMoE-1B-7B": EXPERTS["OLMoE-1B-7B"]}
    else:
        decode = [(b, n, False, False) for b in (1, 4, 16) for n in (128, 512, 2048, 8192) if b * n <= 32768]
        decode += [(16, 2048, True, False), (16, 2048, False, True)]
        prefill, counts, experts = (512, 2048), (1, 2, 4, 8, 16, 32, 64), EXPERTS
    rows = decode_rows(decode, roofs, repeats, before)
    rows += prefill_rows(prefill, roofs, repeats, before)
    rows += expert_rows(experts, counts, roofs, repeats)
    rows += prefill_expert_rows((32, 64) if args.quick else (16, 32, 64, 128), roofs, repeats)
    projections = {k: v for k, v in PROJECTIONS.items() if not args.quick or k != "down 1024x3584"}
    rows += projection_rows(projections, (1, 2, 4, 8), roofs, repeats)
    for row in rows:
        rates(row, roofs)
    load_after = os.getloadavg()
    roof_summary = roofs.summary()
    CONSOLE.print(
        f"roofs (best of run): read {roofs.best('read') / 1e9:.1f} GB/s "
        f"(4 KiB pages: {roofs.best('read 4k') / 1e9:.1f}), "
        f"copy {roofs.best('copy') / 1e9:.1f} GB/s, GEMM fp32 {roofs.best('gemm fp32') / 1e9:.0f} GFLOP/s, "
        f"bf16 {roofs.best('gemm bf16') / 1e9:.0f} GFLOP/s"
    )
    for op, unit, scale in (
        ("decode attention", "GB/s", 1e9),
        ("prefill attention", "GFLOP/s", 1e9),
        ("expert FFN", "GB/s", 1e9),
        ("expert FFN prefill", "GFLOP/s", 1e9),
        ("projection", "GB/s", 1e9),
    ):
        CONSOLE.print(
            table(f"{op}: best rate (fraction of roof)", [r for r in rows if r["op"] == op], unit, scale)
        )
    CONSOLE.print(f"load average before {load_before}, after {load_after}")
    meta = {
        "machine": info,
        "threads": args.threads,
        "clock": args.clock,
        "torch": torch.__version__,
        "cpu_kernel_block": cpu_expert.isa() if cpu_expert.library() is not None else None,
        "quick": args.quick,
        "baseline": args.baseline if "before" in before else None,
        "torch_path": TORCH_PATH if "torch path" in before else None,
        "cycle_bytes": CYCLE,
        "load_before": load_before,
        "load_after": load_after,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.write_text(json.dumps({"meta": meta, "roofs": roof_summary, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
