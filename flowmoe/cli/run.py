"""`flowmoe run`: a prompt file through a model with a scheduler, results appended to a JSONL file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from attrs import evolve
from rich.markup import escape
from rich.progress import Progress, ProgressColumn, Task, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from flowmoe.cli.args import (
    ATTENTION_FORMAT_HELP,
    BYTES,
    EXPERT_FORMAT_HELP,
    FRACTION,
    NON_NEGATIVE_INT,
    OUTPUT_FILE,
    POSITIVE_INT,
    TOKENS_OR_SIZE,
    FloatRange,
)
from flowmoe.cli.option_flags import add_option_flags, cautions, check_taken, given_options, options_of
from flowmoe.cli.ray_run import add_ray_flags, run_on_ray
from flowmoe.cli.simulate import auto_scheduler
from flowmoe.cli.trace import device_table, stats_table
from flowmoe.cli.ui import NO_GPU, console, progress, table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.cost import RooflineCost
from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.hardware import hardware
from flowmoe.core.options import check_options
from flowmoe.core.policy import ATTENTION_FORMATS, EXPERT_FORMATS, Policy, parse_bytes
from flowmoe.core.routing_trace import ROUTING_RECORD, RoutingTrace
from flowmoe.core.synthetic_routing import observed_popularity
from flowmoe.core.threads import plan_threads, usable_cores
from flowmoe.core.write_guard import Guard, Named
from flowmoe.jobs.formats import NATIVE, OPENAI, detect, layout
from flowmoe.jobs.joblog import check_output, holder_file
from flowmoe.model.tokenizer import TextCodec
from flowmoe.schedulers.registry import available, default_name
from flowmoe.schedulers.registry import load as load_scheduler
from flowmoe.study.sim_report import trace_device_stats, trace_stats
from flowmoe.traces.chrome import CHROME_TRACE, write_chrome

if TYPE_CHECKING:  # these run tensors: imported by the functions that run (`flowmoe --help` needs no torch)
    from flowmoe.jobs.job import JobReport, JobSpec
    from flowmoe.jobs.sampling import SamplingParams
    from flowmoe.model.loading import Packing
    from flowmoe.model.moe_model import MoEModel
    from flowmoe.model.quant_error import QuantError
    from flowmoe.runtime.runner import Runtime

log = structlog.get_logger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="generate completions for a JSONL prompt file")
    run.add_argument(
        "-m", "--model", help="checkpoint folder, org/name in the Hugging Face cache, or preset (default: "
        "the built-in tiny model)",
    )  # fmt: skip
    run.add_argument(
        "-p", "--prompts", required=True, type=Path,
        help="JSONL: {id, prompt}, {id, input_ids} or {id, messages}; or an OpenAI batch (see --format)",
    )  # fmt: skip
    run.add_argument("-o", "--output", required=True, type=Path, help="JSONL results, appended and resumable")
    run.add_argument(
        "--format", choices=(NATIVE, OPENAI),
        help=f"of --prompts and --output: {NATIVE}'s own, or {OPENAI}'s batch format ({{custom_id, method, "
        f"url, body}} in, {{id, custom_id, response, error}} out); default: {OPENAI} when the first line has "
        f"a custom_id and no id, else {NATIVE}",
    )  # fmt: skip
    run.add_argument(
        "-n", "--max-new-tokens", type=POSITIVE_INT, default=32,
        help="per request (%(type)s; an OpenAI batch request's max_tokens overrides it)",
    )  # fmt: skip
    run.add_argument(
        "--prefill-chunk", type=POSITIVE_INT,
        help="a micro-batch's tokens per forward pass, at most: a longer prefill runs in chunks, which "
        "bounds its working memory (%(type)s; default: 128 for bf16 / fp16 weights where the KV cache "
        "lives on the CPU alone and torch emulates that dtype, else no limit; llama.cpp's n_ubatch is 512)",
    )  # fmt: skip
    run.add_argument(
        "-s", "--scheduler",
        help="scheduler plugin (see `flowmoe schedulers`), or auto (default: eager where the run uses a GPU, "
        "cpu where it does not: the whole model on the CPU, a node per layer; with --ray, cpu only with "
        "--device cpu)",
    )  # fmt: skip
    run.add_argument("--trace", type=OUTPUT_FILE, help="write a Chrome trace (open it in Perfetto)")
    run.add_argument(
        "--trace-kernels",
        action="store_true",
        help="with --trace: run under torch.profiler and add the kernels and copies that really ran (on "
        "a CPU-only run, the CPU operations) as tracks under each GPU lane; slows the run down",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="print the job's report and run statistics as one JSON object on stdout "
        "(keeps every node's span in memory for the statistics, as --trace does)",
    )
    run.add_argument(
        "--record-routing", type=OUTPUT_FILE, help="write the gates' expert counts (flowmoe simulate)"
    )
    run.add_argument("--hardware", help="preset or calibrated profile the scheduler's latency model uses")
    run.add_argument(
        "--routing-profile",
        type=Path,
        help="a --record-routing trace: its expert popularity places experts (fiddler, cgopipe, klotski)",
    )
    run.add_argument(
        "-b",
        "--batch-size",
        type=POSITIVE_INT,
        default=16,
        help="sequences in flight, over all micro-batches (%(type)s)",
    )
    run.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    run.add_argument("--layers", type=POSITIVE_INT, help="cut a preset to its first LAYERS layers (%(type)s)")
    run.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add_force_flag(run)
    add_policy_flags(run)
    add_ray_flags(run)
    mode = run.add_mutually_exclusive_group()
    from_checkpoint = "the checkpoint's generation_config.json where it samples, else"
    mode.add_argument(
        "--greedy", action="store_true",
        help="greedy decoding (the default, unless the checkpoint's generation_config.json samples)",
    )  # fmt: skip
    mode.add_argument(
        "--temperature", type=FloatRange(0.0), help=f"0: greedy (%(type)s; default: {from_checkpoint} 0)"
    )
    run.add_argument(
        "--top-p", type=FloatRange(0.0, 1.0, low_open=True),
        help=f"sample from the most likely tokens holding this much probability (%(type)s; default: "
        f"{from_checkpoint} 1)",
    )  # fmt: skip
    run.add_argument(
        "--top-k", type=NON_NEGATIVE_INT, help=f"0: no top-k cut (%(type)s; default: {from_checkpoint} 0)"
    )
    run.add_argument("--seed", type=int, default=0, help="sampling seed (an integer)")
    run.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    run.add_argument("--chat", action="store_true", help="render each prompt with the chat template")
    run.add_argument(
        "--kv-budget",
        type=TOKENS_OR_SIZE,
        help="KV cache per micro-batch (slots × capacity): %(type)s",
    )
    run.set_defaults(handler=_run)


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """The Policy knobs (flowmoe/core/policy.py); `flowmoe plan` suggests values for a setup."""
    group = parser.add_argument_group("policy")
    group.add_argument(
        "--gpu-memory",
        type=BYTES,
        help="GPU memory budget, flowmoe's own accounting (%(type)s; default: no limit)",
    )
    group.add_argument(
        "--micro-batches",
        type=POSITIVE_INT,
        default=1,
        help="micro-batches per batch (%(type)s)",
    )
    group.add_argument("--attention-on", choices=("gpu", "cpu"), default="gpu")
    group.add_argument("--ffn-on", choices=("gpu", "cpu"), default="gpu")
    group.add_argument(
        "--weights-gpu-share",
        type=FRACTION,
        default=1.0,
        help="share of experts kept on the GPU (%(type)s)",
    )
    group.add_argument(
        "--kv-gpu-share",
        type=FRACTION,
        default=1.0,
        help="share of the KV cache kept on the GPU (%(type)s)",
    )
    group.add_argument(
        "--cpu-threads", type=POSITIVE_INT,
        help="host threads computing at once, split over the host's compute threads (at most the usable "
        "cores; default: OMP_NUM_THREADS, else the usable cores no other process keeps busy; %(type)s)",
    )  # fmt: skip
    group.add_argument("--expert-format", choices=EXPERT_FORMATS, default="native", help=EXPERT_FORMAT_HELP)
    group.add_argument(
        "--attention-format", choices=ATTENTION_FORMATS, default="native", help=ATTENTION_FORMAT_HELP
    )
    group.add_argument(
        "--lm-head-format", choices=ATTENTION_FORMATS, default="native",
        help="the LM head's [vocab, hidden]: native, or quantized as a bf16/fp16/fp32 model loads to int8, "
        "int4 or hqq4 (the layouts of --expert-format), computed on the CPU from the packed bytes and "
        "dequantized for a GPU; an untied head only (docs/quantized-attention.md)",
    )  # fmt: skip
    add_option_flags(parser)


def policy_from(args: argparse.Namespace) -> Policy:
    """The policy the flags give, with the options of --scheduler (none for auto, which takes none)."""
    options = () if args.scheduler == "auto" else (options_of(args.scheduler, given_options(args)),)
    return Policy(
        micro_batch_size=max(1, -(-args.batch_size // args.micro_batches)),
        micro_batches=args.micro_batches,
        attention_on=args.attention_on,
        ffn_on=args.ffn_on,
        weights_gpu_share=args.weights_gpu_share,
        kv_gpu_share=args.kv_gpu_share,
        gpu_memory=args.gpu_memory,
        cpu_threads=args.cpu_threads,
        expert_format=args.expert_format,
        attention_format=args.attention_format,
        options=options,
    )


def _run(args: argparse.Namespace) -> int:
    import uvloop

    from flowmoe.jobs.job import Progress as JobProgress
    from flowmoe.jobs.job import run_job
    from flowmoe.model.builtin import ensure_builtin
    from flowmoe.runtime.device_weights import Devices
    from flowmoe.runtime.runner import Runtime
    from flowmoe.traces.profiler import kernels_into

    if args.scheduler is None:  # a Ray job's replicas: a GPU each unless --device cpu (cluster/resources.py)
        args.scheduler = default_name(args.device != "cpu" if args.ray else Devices.detect(args.device).cuda)
    if args.scheduler != "auto":
        load_scheduler(args.scheduler)  # an unknown or broken plugin fails before the model loads
    given = given_options(args)  # options --scheduler takes (auto: every scheduler must take them)
    check_taken(given, list(available()) if args.scheduler == "auto" else [args.scheduler])
    guard = write_guard(args, [("--output", args.output, None), ("--trace", args.trace, CHROME_TRACE),
                               ("--record-routing", args.record_routing, ROUTING_RECORD)],
                        Named("the lock sidecar of --output", holder_file(args.output)))  # fmt: skip
    args.format = args.format or detect(args.prompts)
    check_output(args.output, guard, layout(args.format))  # so does an --output not ours, or in use
    if args.trace_kernels and not args.trace:
        raise ConfigError("--trace-kernels adds tracks to the trace: give --trace FILE as well")
    sampling = sampling_from(args)
    policy = policy_from(args)
    if args.ray:  # one job over many replicas (flowmoe/cluster)
        if args.format == OPENAI:
            raise ConfigError("an OpenAI batch runs in a single process; --ray takes flowmoe prompt files")
        quantized = (("--attention-format", args.attention_format), ("--lm-head-format", args.lm_head_format))
        for flag, form in quantized:
            if form != "native":
                raise ConfigError(f"{flag} quantizes the model one process loads; --ray's replicas "
                                  "load their own: leave one of them out")  # fmt: skip
        return run_on_ray(args, sampling, policy, guard)
    if args.replicas:
        raise FlowmoeError("--replicas needs --ray ADDRESS (--ray local: this machine's CPUs)")
    plan_threads(usable_cores(), args.cpu_threads)  # more threads than cores fail before the model loads
    source = args.model or str(ensure_builtin())
    packing = packing_from(args)
    model = load_with_progress(source, args.dtype, args.layers, packing)
    if args.scheduler != "auto":  # its options against the model: a page size against its experts, …
        check_options(policy.options_for(load_scheduler(args.scheduler).Options), model.spec)
    for line in cautions(given):  # e.g. --defer-experts: KTransformers' Expert Deferral changes outputs
        console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)
    codec = TextCodec.from_folder(source) if Path(source).is_dir() else None
    job = job_from(args, model, sampling)
    quantization = measured_for_run(model, source, codec, job, packing)
    measured = quantization.as_json() if quantization else None
    job = evolve(
        job,
        expert_format=policy.expert_format,
        attention_format=policy.attention_format,
        lm_head_format=args.lm_head_format,
        quantization=measured,
        prefill_chunk=args.prefill_chunk,
    )
    if args.scheduler == "auto":  # every scheduler simulated on this job; the best runs, its policy too
        args.scheduler, policy, job = auto_scheduler(args, model, codec, job)
    cost = RooflineCost(hardware(args.hardware), model.spec) if args.hardware else None
    popularity = routing_profile(args.routing_profile, model) if args.routing_profile else None
    runtime = Runtime.create(
        model,
        args.scheduler,
        evolve(policy, attention_format="native"),  # it keeps and copies the attention unpacked (as priced)
        args.device,
        cost,
        record=bool(args.trace or args.json),
        popularity=popularity,
    )
    runtime.routing = RoutingTrace.for_model(model.spec) if args.record_routing else None
    try:
        with progress(TextColumn("{task.fields[tokens]} tokens"), TokenRateColumn()) as bar:
            task = bar.add_task("generating", total=None, tokens=0)
            hooks = JobProgress(
                started=lambda total: bar.update(task, total=total),
                finished=lambda _r: bar.advance(task),
                generated=token_counter(bar, task),
            )
            with kernels_into(runtime.trace, runtime.devices.cuda, args.trace_kernels):
                report = uvloop.run(run_job(job, model, codec, runtime, hooks))
    except BaseException:  # interrupted or failed: what ran is still written, then the error goes on
        runtime.close()
        for failure in save_records(args, runtime, guard):
            console.print(f"flowmoe: error: {failure}", soft_wrap=True, highlight=False, markup=False)
        raise
    runtime.close()
    failures = save_records(args, runtime, guard)
    for error in report.bad_lines:  # an OpenAI batch answers each with an error line in --output
        console.print(f"[yellow]{'error line' if args.format == OPENAI else 'skipped'}[/] {escape(error)}",
                      soft_wrap=True)  # fmt: skip
    console.print(summary_table(report, source, args.scheduler))
    if quantization is not None:  # a quantized run says so, with the error it introduced
        console.print(f"[yellow]{escape(quantization.line())}[/]", soft_wrap=True)
    if runtime.trace.gpu_emulated:
        console.print(NO_GPU, highlight=False)
    scheduler_report = runtime.scheduler.report()
    if scheduler_report:  # e.g. pre-gated's prediction hit rate, lru-cache's hits
        console.print(f"{args.scheduler}: {figures(scheduler_report)}")
    if runtime.trace.spans:  # kept with --trace: the run statistics, as `flowmoe trace summarize` gives them
        console.print(stats_table(args.scheduler, trace_stats(runtime.trace)))
    if runtime.trace.kernels:  # --trace-kernels: what the device did inside the GPU lanes' spans
        console.print(device_table(args.scheduler, trace_device_stats(runtime.trace)))
    if args.json:
        print(json.dumps(run_json(report, args.scheduler, runtime, scheduler_report, job.quantization)))
    for failure in failures:  # the job's results are in --output; only a record could not be written
        console.print(f"flowmoe: error: {failure}", soft_wrap=True, highlight=False, markup=False)
    return 2 if failures else 0


def run_json(
    report: JobReport,
    scheduler: str,
    runtime: Runtime,
    scheduler_report: dict[str, float],
    quantization: dict[str, Any] | None = None,
) -> dict:
    """`run --json`: the job's counts and timings, the scheduler's own figures, the run statistics
    with the definitions `simulate`, `compare` and `trace summarize` use (traces/stats.py), and the
    error quantized experts introduced (model/quant_error.py; None where none were quantized)."""
    stats = report.stats
    return {
        "scheduler": scheduler,
        "requests": report.requests,
        "skipped_done": report.skipped,
        "bad_lines": list(report.bad_lines),
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.steps,
        "prefill_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "tokens_per_second": stats.tokens_per_second,
        "scheduler_report": scheduler_report or None,
        "stats": trace_stats(runtime.trace).to_json() if runtime.trace.spans else None,
        "quantization": quantization,
    }


def packing_from(args: argparse.Namespace) -> Packing:
    """--expert-format, --attention-format and --lm-head-format as the load packs the weights
    (model/loading.py), quantizing on the run's GPU where it has one."""
    from flowmoe.model.loading import Packing
    from flowmoe.runtime.device_weights import Devices

    gpu = Devices.detect(args.device).gpu
    return Packing(args.expert_format, args.attention_format, gpu, args.lm_head_format)


def measured_for_run(
    model: MoEModel,
    source: str,
    codec: TextCodec | None,
    job: JobSpec,
    packing: Packing,
) -> QuantError | None:
    """Where the load quantized weights in the model's dtype (--expert-format int8, int4, hqq4;
    --attention-format), the error that introduced on the job's first prompts; a checkpoint
    quantized before (GPTQ, AWQ, compressed-tensors) is reported whatever the format."""
    from flowmoe.jobs.job import read_work
    from flowmoe.model.quant_error import measured

    if packing.quantizes:
        limits = job.limits(model)
        first = read_work(job, model, codec, limits).requests[: limits.micro_batch_size]
    else:  # native and fp8 measure nothing; a GPTQ, AWQ or compressed-tensors checkpoint is reported
        first = []
    return measured(model, source, packing, [r.input_ids for r in first])


def routing_profile(path: Path, model: MoEModel) -> tuple[tuple[float, ...], ...]:
    """Each layer's expert token shares in a recorded routing trace (uniform where it has none)."""
    uniform = (1.0 / model.spec.moe.experts,) * model.spec.moe.experts
    shares = observed_popularity(model.spec, RoutingTrace.load(path, model.spec))
    return tuple(row or uniform for row in shares)


def save_records(args: argparse.Namespace, runtime: Runtime, guard: Guard) -> list[str]:
    """Write --record-routing and --trace through the write guard; one line for each that could
    not be written."""
    failures = []
    if runtime.routing is not None:
        try:
            runtime.routing.save(args.record_routing, guard)
        except FlowmoeError as exc:
            failures.append(str(exc))
    if args.trace:
        try:
            write_chrome(args.trace, [runtime.trace], guard)
        except FlowmoeError as exc:
            failures.append(str(exc))
        else:
            kernels = f", {len(runtime.trace.kernels)} kernels" if args.trace_kernels else ""
            console.print(
                f"trace: {args.trace} ({len(runtime.trace.spans)} nodes{kernels}; open in https://ui.perfetto.dev)"
            )
    return failures


def figures(report: dict[str, float]) -> str:
    """A scheduler's report: counts as integers, rates to three digits."""
    return ", ".join(f"{k} {int(v)}" if float(v).is_integer() else f"{k} {v:.3g}" for k, v in report.items())


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    """--temperature, --top-p and --top-k, each not given taken from the checkpoint's
    generation_config.json (transformers' reading of it), else greedy; --greedy overrides all."""
    from flowmoe.core.generation_config import FILE, read_generation_config
    from flowmoe.jobs.sampling import SamplingParams

    folder = Path(args.model) if args.model and Path(args.model).is_dir() else None
    generation = read_generation_config(folder) if folder else None
    temperature, top_p, top_k = generation.sampling() if generation else (0.0, 1.0, 0)
    given = (args.temperature, args.top_p, args.top_k)
    if folder and generation and generation.do_sample and None in given and not args.greedy:
        log.info("sampling defaults", source=str(folder / FILE), temperature=temperature, top_p=top_p,
                 top_k=top_k)  # fmt: skip
    temperature = 0.0 if args.greedy else temperature if args.temperature is None else args.temperature
    top_p = top_p if args.top_p is None else args.top_p
    top_k = top_k if args.top_k is None else args.top_k
    return SamplingParams(temperature, top_p, top_k, args.seed)


def job_from(args: argparse.Namespace, model: MoEModel, sampling: SamplingParams) -> JobSpec:
    from flowmoe.jobs.job import JobSpec
    from flowmoe.jobs.provenance import model_identity
    from flowmoe.model.builtin import ensure_builtin

    if any(not s for s in args.stop):
        raise FlowmoeError("--stop must not be empty")
    budget = kv_budget_tokens(args.kv_budget, model) if args.kv_budget else None
    source = args.model or str(ensure_builtin())
    produced_by = model_identity(source, args.dtype, args.layers) if Path(source).is_dir() else None
    return JobSpec(args.prompts, args.output, args.max_new_tokens, sampling, args.batch_size,
                   args.micro_batches, budget, tuple(args.stop), args.chat,
                   produced_by, args.force, args.format, model_names(source))  # fmt: skip


def model_names(source: str) -> tuple[str, ...]:
    """The names an OpenAI batch request's "model" may give for this run's model: a cached
    snapshot's org/name (which the responses give), the checkpoint folder's name, --model itself."""
    from flowmoe.core.hf_cache import repo_id_of

    repo = repo_id_of(Path(source))
    return tuple(dict.fromkeys(n for n in (repo, Path(source).name, source) if n))


def kv_budget_tokens(text: str, model: MoEModel) -> int:
    """--kv-budget as tokens: a plain number is tokens, a size is bytes of KV cache."""
    if text.strip().isdigit():
        return int(text)
    tokens = parse_bytes(text) // model.spec.kv_bytes_per_token
    if tokens < 1:
        raise FlowmoeError(f"--kv-budget {text} holds no token ({model.spec.kv_bytes_per_token} bytes each)")
    return tokens


def token_counter(bar: Progress, task: TaskID) -> Callable[[int], None]:
    """Adds each step's generated tokens to the bar's `tokens` field."""
    total = 0

    def add(tokens: int) -> None:
        nonlocal total
        total += tokens
        bar.update(task, tokens=total)

    return add


class TokenRateColumn(ProgressColumn):
    """Generated tokens per second since the bar started."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        rate = task.fields.get("tokens", 0) / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:.1f} tok/s")


def load_with_progress(source: str, dtype: str | None, layers: int | None, packing: Packing) -> MoEModel:
    from flowmoe.model.loading import load_model

    with progress() as bar:
        task = bar.add_task(f"loading {Path(source).name}", total=None)
        return load_model(
            source, dtype, layers, lambda done, total: bar.update(task, completed=done, total=total), packing
        )


def summary_table(report: JobReport, model: str, scheduler: str) -> Table:
    stats = report.stats
    columns = (
        "requests",
        "skipped\n(done)",
        "prompt\ntokens",
        "generated",
        "prefill s",
        "decode s",
        "tokens/s",
    )
    result = table(f"flowmoe run — {Path(model).name} — {scheduler}", columns, justify="right")
    result.add_row(
        str(report.requests), str(report.skipped), str(stats.prompt_tokens), str(stats.generated_tokens),
        f"{stats.prefill_seconds:.3f}", f"{stats.decode_seconds:.3f}", f"{stats.tokens_per_second:.1f}",
    )  # fmt: skip
    return result
