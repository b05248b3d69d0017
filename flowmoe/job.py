"""An offline generation job: prompt file in, one JSONL result per request out, resumable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from attrs import define, field, frozen

from flowmoe.engine import Engine, Request, Result, StepRunner, StepStats
from flowmoe.joblog import JobLog
from flowmoe.model import MoEModel
from flowmoe.prompts import read_prompts
from flowmoe.sampling import SamplingParams
from flowmoe.tokenizer import TextCodec

log = structlog.get_logger("flowmoe.job")


@frozen
class JobSpec:
    prompts: Path
    output: Path
    max_new_tokens: int = 32
    sampling: SamplingParams = field(factory=SamplingParams)
    batch_size: int = 16


@define
class JobReport:
    requests: int
    skipped: int
    bad_lines: tuple[str, ...]
    stats: StepStats


@define
class Progress:
    """Callbacks a front end (the CLI's progress bar) can hook."""

    started: Callable[[int], None] = lambda total: None
    finished: Callable[[Result], None] = lambda result: None


def build_requests(
    job: JobSpec, model: MoEModel, codec: TextCodec | None
) -> tuple[list[Request], tuple[str, ...]]:
    prompt_file = read_prompts(job.prompts, model.spec.vocab, codec is not None)
    requests = []
    for index, line in enumerate(prompt_file.prompts):
        ids = line.input_ids if line.input_ids is not None else tuple(codec.encode(line.prompt))  # type: ignore[union-attr]
        requests.append(Request(line.id, ids, index))
    return requests, prompt_file.errors


async def run_job(
    job: JobSpec,
    model: MoEModel,
    codec: TextCodec | None,
    runner: StepRunner,
    progress: Progress | None = None,
) -> JobReport:
    progress = progress or Progress()
    requests, errors = build_requests(job, model, codec)
    for error in errors:
        log.warning("bad prompt line skipped", error=error)
    output = JobLog.open(job.output)
    todo = [r for r in requests if r.id not in output.done]
    stop = frozenset(model.spec.eos_token_ids) | (codec.eos_ids if codec else frozenset())
    cache_device = getattr(runner, "cache_device", torch.device("cpu"))
    engine = Engine(model, runner, job.sampling, job.max_new_tokens, stop, cache_device)
    check = getattr(runner, "check_memory", None)
    if check is not None and todo:
        longest = sorted((len(r.input_ids) for r in todo), reverse=True)[: job.batch_size]
        check(len(longest), longest[0] + job.max_new_tokens, sum(longest))
    progress.started(len(todo))
    try:
        for start in range(0, len(todo), job.batch_size):
            batch = todo[start : start + job.batch_size]
            async for result in engine.run_batch([engine.micro_batch(0, batch)]):
                text = codec.decode(result.output_ids) if codec else None
                output.append({"id": result.id, "output_ids": list(result.output_ids), "text": text,
                               "finish_reason": result.finish_reason})  # fmt: skip
                progress.finished(result)
    finally:
        output.close()
    return JobReport(len(todo), len(requests) - len(todo), errors, engine.stats)
