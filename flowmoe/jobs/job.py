"""An offline generation job: prompt file in, one JSONL result per request out, resumable.

Requests already in the output are skipped, so re-running the same command
continues an interrupted job; a bad prompt line (or one the model cannot take)
is reported with its line number and the rest of the job runs. The prompt file is
flowmoe's own (jobs/prompts.py) or an OpenAI batch (jobs/openai_batch.py), whose
requests that cannot run are answered with an error line each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from attrs import define, field, frozen

from flowmoe.core.errors import ConfigError, PromptFileError
from flowmoe.core.scheduling import BatchShape
from flowmoe.jobs.batching import BatchLimits, Request, plan_batch
from flowmoe.jobs.engine import Engine, JobRunner, Result, StepStats
from flowmoe.jobs.formats import NATIVE, OPENAI, layout
from flowmoe.jobs.joblog import JobLog, LogLayout
from flowmoe.jobs.openai_batch import Responses, batch_requests, error_line
from flowmoe.jobs.prompts import PromptLine, in_vocab, max_line_bytes, read_prompts
from flowmoe.jobs.provenance import check_and_record
from flowmoe.jobs.sampling import SamplingParams
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.tokenizer import StopStrings, TextCodec

log = structlog.get_logger("flowmoe.jobs.job")


@frozen
class JobSpec:
    prompts: Path
    output: Path
    max_new_tokens: int = 32
    sampling: SamplingParams = field(factory=SamplingParams)
    batch_size: int = 16  # sequences in flight, over all micro-batches
    micro_batches: int = 1
    kv_budget: int | None = None  # KV tokens per micro-batch
    stop: tuple[str, ...] = ()  # stop strings
    chat: bool = False  # wrap each "prompt" as a user message of the chat template
    produced_by: dict[str, Any] | None = None  # the model's identity (jobs/provenance.py); None: not recorded
    force: bool = False  # resume even when the output's record names other settings
    format: str = NATIVE  # of the prompt file and the output: NATIVE or OPENAI
    model_names: tuple[str, ...] = ()  # an OpenAI batch request's "model" is one; responses give the first
    expert_format: str = "native"  # how the experts are kept (Policy.expert_format); recorded
    attention_format: str = "native"  # the attention projections' (Policy.attention_format); recorded
    lm_head_format: str = "native"  # the LM head's (--lm-head-format); recorded
    quantization: dict[str, Any] | None = None  # the error quantize-on-load introduced (model/quant_error.py)
    prefill_chunk: int | None = None  # a micro-batch's tokens per runner call (--prefill-chunk); recorded

    def settings(self) -> dict[str, Any]:
        """Everything a result depends on, as the output's run record keeps it (jobs/provenance.py)."""
        s = self.sampling
        batch = {"--format": self.format} if self.format != NATIVE else {}  # records before it read as native
        packed = {"--expert-format": self.expert_format} if self.expert_format != "native" else {}  # so too
        if self.attention_format != "native":
            packed["--attention-format"] = self.attention_format
        if self.lm_head_format != "native":
            packed["--lm-head-format"] = self.lm_head_format
        return {**(self.produced_by or {}), "--max-new-tokens": self.max_new_tokens,
                "--temperature": s.temperature, "--top-p": s.top_p, "--top-k": s.top_k, "--seed": s.seed,
                "--stop": list(self.stop), "--chat": self.chat, **batch, **packed,
                **self._chunk()}  # fmt: skip

    def _chunk(self) -> dict[str, int]:
        """--prefill-chunk where the job sets one: it changes a prefill's floats."""
        return {"--prefill-chunk": self.prefill_chunk} if self.prefill_chunk is not None else {}

    @property
    def layout(self) -> LogLayout:
        """What each line of the output holds."""
        return layout(self.format)

    def limits(self, model: MoEModel) -> BatchLimits:
        return BatchLimits(
            micro_batches=self.micro_batches,
            micro_batch_size=max(1, -(-self.batch_size // self.micro_batches)),
            max_new_tokens=self.max_new_tokens,
            kv_budget=self.kv_budget,
            max_length=model.spec.max_positions,
        )


@define
class JobReport:
    requests: int
    skipped: int
    bad_lines: tuple[str, ...]
    stats: StepStats


@frozen
class Work:
    """A job's prompt file read: what runs, and how its output lines are made."""

    requests: list[Request]
    errors: tuple[str, ...]  # "FILE:LINE: what is wrong" per line that does not run
    answered: tuple[dict[str, Any], ...]  # output lines of requests answered with an error (OpenAI batch)
    line: Callable[[Result], dict[str, Any]]  # a result's output line


def read_work(job: JobSpec, model: MoEModel, codec: TextCodec | None, limits: BatchLimits) -> Work:
    """The job's requests in its format, with the errors of the lines that do not run."""
    if job.format != OPENAI:
        requests, errors = build_requests(job, model, codec, limits)
        return Work(requests, errors, (), partial(record, codec=codec))
    if codec is None:
        raise ConfigError("an OpenAI batch needs a tokenizer.json beside the model (its responses are text)")
    if job.chat:
        raise ConfigError(
            "--chat is for flowmoe prompt files; an OpenAI batch request's url says if it is chat"
        )
    batch = batch_requests(job.prompts, model, codec, limits, job.sampling, job.model_names)
    errors = tuple(f"{job.prompts}:{a.line}: request {a.custom_id!r}: {a.message}" for a in batch.answered)
    responses = Responses(batch.urls, job.model_names[0] if job.model_names else "", codec)
    return Work(list(batch.requests), errors, tuple(map(error_line, batch.answered)), responses.response)


@define
class Progress:
    """Callbacks a front end (the CLI's progress bar) can hook."""

    started: Callable[[int], None] = lambda total: None
    finished: Callable[[Result], None] = lambda result: None
    generated: Callable[[int], None] = lambda tokens: None  # tokens generated by each step


def build_requests(
    job: JobSpec, model: MoEModel, codec: TextCodec | None, limits: BatchLimits
) -> tuple[list[Request], tuple[str, ...]]:
    """Prompt lines -> requests, and one "FILE:LINE: what is wrong" per line that cannot run."""
    if job.chat and (codec is None or codec.chat is None):
        raise ConfigError("--chat needs a chat template beside the model (tokenizer_config.json)")
    can_chat = codec is not None and codec.chat is not None
    vocab, bound = model.spec.vocab, max_line_bytes(model.spec.max_positions)
    prompt_file = read_prompts(job.prompts, vocab, codec is not None, can_chat, bound)
    requests, errors = [], list(prompt_file.errors)
    for index, line in enumerate(prompt_file.prompts):
        try:
            request = Request(line.id, in_vocab(_input_ids(line, codec, job.chat), vocab), index)
            problem = limits.problem(request)
            if problem is not None:
                raise PromptFileError(problem)
            requests.append(request)
        except PromptFileError as exc:
            errors.append(f"{job.prompts}:{line.line}: {exc}")
    if not requests:  # every line failed its length, KV or tokenizer check: nothing would run
        raise PromptFileError(f"{job.prompts}: no prompt line can run; first problem: {errors[0]}")
    return requests, tuple(errors)


def _input_ids(line: PromptLine, codec: TextCodec | None, chat: bool) -> tuple[int, ...]:
    if line.input_ids is not None:
        return line.input_ids
    assert codec is not None  # read_prompts refuses text and messages without a tokenizer
    if line.messages is not None:
        return tuple(codec.encode_chat(line.messages))
    assert line.prompt is not None
    if chat:
        return tuple(codec.encode_chat([{"role": "user", "content": line.prompt}]))
    return tuple(codec.encode(line.prompt))


def record(result: Result, codec: TextCodec | None) -> dict[str, Any]:
    """One output line."""
    text = result.text if result.text is not None else codec.decode(result.output_ids) if codec else None
    return {"id": result.id, "output_ids": list(result.output_ids), "text": text,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens}  # fmt: skip


async def run_job(
    job: JobSpec,
    model: MoEModel,
    codec: TextCodec | None,
    runner: JobRunner,
    progress: Progress | None = None,
) -> JobReport:
    progress = progress or Progress()
    if job.stop and codec is None:
        raise ConfigError("--stop needs a tokenizer.json beside the model to decode the output")
    limits = job.limits(model)
    work = read_work(job, model, codec, limits)
    requests, errors = work.requests, work.errors
    for error in errors:
        log.warning("bad prompt line skipped" if not work.answered else "request answered with an error",
                    error=error)  # fmt: skip
    engine = make_engine(job, model, codec, runner, progress)
    output = JobLog.open(job.output, job.prompts, layout=job.layout)
    todo = [r for r in requests if r.id not in output.done]
    started, done = time.perf_counter(), 0
    try:
        if job.produced_by is not None:
            notes = {"quantization": job.quantization} if job.quantization else {}
            check_and_record(job.output, job.prompts, job.settings(), bool(output.done), job.force, notes)
        log.info("job started", prompts=str(job.prompts), output=str(job.output), requests=len(todo),
                 skipped=len(requests) - len(todo), bad_lines=len(errors))  # fmt: skip
        check_memory(runner, todo, limits)
        for line in work.answered:
            if line[job.layout.request_id] not in output.done:
                output.append(line)
        progress.started(len(todo))
        async for result in engine.generate(todo, limits):
            output.append(work.line(result))
            done += 1
            progress.finished(result)
    finally:
        output.close()
        stats = engine.stats
        event = "job finished" if done == len(todo) else "job interrupted"
        log.info(event, requests=done, of=len(todo), generated_tokens=stats.generated_tokens,
                 seconds=round(time.perf_counter() - started, 3),
                 tokens_per_second=round(stats.tokens_per_second, 1))  # fmt: skip
    return JobReport(len(todo), len(requests) - len(todo), errors, engine.stats)


def make_engine(
    job: JobSpec, model: MoEModel, codec: TextCodec | None, runner: JobRunner, progress: Progress
) -> Engine:
    """The generation loop of a job: its sampling, stop ids and strings, on the runner's cache device."""
    stop_ids = frozenset(model.spec.eos_token_ids) | (codec.eos_ids if codec else frozenset())
    engine = Engine(
        model,
        runner,
        job.sampling,
        job.max_new_tokens,
        stop_ids,
        runner.cache_device,
        stop_strings=StopStrings(codec, job.stop) if job.stop and codec else None,
        on_step=progress.generated,
        codec=codec,
    )
    if job.prefill_chunk is not None:  # else the engine's default for its cache's device
        engine.prefill_chunk = job.prefill_chunk
    return engine


def first_batch(todo: list[Request], limits: BatchLimits) -> BatchShape:
    """The first (largest) batch the engine plans of `todo`, as the memory check sees it."""
    batch, _ = plan_batch(todo, limits)
    prompts = (tuple(len(r.input_ids) for r in mb.requests) for mb in batch.micro_batches)
    new = (r.new_tokens(limits.max_new_tokens) for mb in batch.micro_batches for r in mb.requests)
    return BatchShape(tuple(p for p in prompts if p), max(new, default=limits.max_new_tokens))


def check_memory(runner: JobRunner, todo: list[Request], limits: BatchLimits) -> None:
    """Fail before the run when the first (largest) batch cannot fit the runner's memory budget."""
    if todo:
        runner.check_memory(first_batch(todo, limits))
