"""Tokens/s of one job over 1 and 2 Ray replicas against the same job in one process, and what the
Ray path costs per request.

The same prompt file runs three ways on this machine: `run_job` in this process (the single-
process job: one runtime, one torch thread, results through JobLog), then `run_on_cluster` with 1
and with 2 replicas (one CPU and one torch thread each) on a local Ray cluster of this machine's
CPUs. Generation time excludes loading the model (and, for Ray, starting the replicas, reported
apart). The three run interleaved, --rounds times, and each keeps its fastest round (the machine
may be shared). The overhead per request is (1-replica time - one-process time) / requests: what the
actor call, the result's trip back to the driver and the driver's bookkeeping add to a request.
Prints a rich table, writes bench/ray_scaling.json.

    python bench/ray_scaling.py [--requests 240] [--max-new-tokens 16] [--rounds 3] [--model P --layers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
import warnings
from pathlib import Path

import ray
import torch
from rich.console import Console
from rich.table import Table

from flowmoe.cluster.ray_job import run_on_cluster
from flowmoe.cluster.replica import ReplicaConfig
from flowmoe.cluster.resources import ReplicaResources
from flowmoe.core.policy import Policy
from flowmoe.jobs.job import JobSpec, run_job
from flowmoe.model.builtin import ensure_builtin
from flowmoe.model.loading import load_model
from flowmoe.model.tokenizer import TextCodec
from flowmoe.runtime.runner import Runtime

WORDS = ("the", "experts", "of", "a", "mixture", "route", "each", "token", "to", "two", "feed")


def prompt_file(path: Path, requests: int) -> Path:
    """`requests` text prompts of 1 to 24 words (seeded)."""
    rng = random.Random(0)
    rows = [{"id": i, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 24)))} for i in range(requests)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def one_process(config: ReplicaConfig) -> dict[str, float]:
    """The single-process job: generation seconds and tokens."""
    torch.set_num_threads(1)
    model = load_model(config.source, config.dtype, config.layers)
    codec = TextCodec.from_folder(config.source) if config.model_folder else None
    runtime = Runtime.create(model, config.scheduler, config.policy, "cpu", record=False)
    try:
        started = time.perf_counter()
        report = asyncio.run(run_job(config.job, model, codec, runtime))
        seconds = time.perf_counter() - started
    finally:
        runtime.close()
    return {"seconds": seconds, "tokens": report.stats.generated_tokens, "startup_seconds": 0.0}


def on_ray(config: ReplicaConfig, replicas: int) -> dict[str, float]:
    cluster = ray.get_runtime_context().gcs_address
    report = asyncio.run(run_on_cluster(config, replicas, ReplicaResources(1, 0), cluster))
    return {
        "seconds": report.seconds,
        "tokens": report.generated_tokens,
        "startup_seconds": report.startup_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", help="preset or checkpoint folder (default: the built-in tiny model)")
    parser.add_argument("--layers", type=int, help="cut a preset to its first layers")
    parser.add_argument(
        "--rounds", type=int, default=3, help="each kind runs this often; the fastest is kept"
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("ray_scaling.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    source = args.model or str(ensure_builtin())
    runs: dict[str, list[dict[str, float]]] = {"one process": [], "ray, 1 replica": [], "ray, 2 replicas": []}
    same = True
    with tempfile.TemporaryDirectory() as folder:
        prompts = prompt_file(Path(folder) / "prompts.jsonl", args.requests)

        def config(name: str) -> ReplicaConfig:
            output = Path(folder) / f"{name}.jsonl"
            output.unlink(missing_ok=True)
            job = JobSpec(prompts, output, args.max_new_tokens, batch_size=args.batch_size)
            return ReplicaConfig(
                source, None, args.layers, "eager", Policy(micro_batch_size=args.batch_size), job
            )

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(
                num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="WARNING"
            )
        try:
            for _ in range(args.rounds):  # interleaved, so a burst of load on the machine hits every kind
                runs["one process"].append(one_process(config("single")))
                runs["ray, 1 replica"].append(on_ray(config("ray1"), 1))
                runs["ray, 2 replicas"].append(on_ray(config("ray2"), 2))
                texts = [
                    sorted((Path(folder) / f"{n}.jsonl").read_text().splitlines())
                    for n in ("single", "ray1", "ray2")
                ]
                same = same and texts[0] == texts[1] == texts[2]
        finally:
            ray.shutdown()
    rows = {name: min(kind, key=lambda r: r["seconds"]) for name, kind in runs.items()}  # the least disturbed
    base = rows["one process"]["seconds"]
    for row in rows.values():
        row["tokens_per_second"] = row["tokens"] / row["seconds"]
        row["speedup"] = base / row["seconds"]
    overhead_ms = (rows["ray, 1 replica"]["seconds"] - base) / args.requests * 1e3
    table = Table(title=f"{Path(source).name}: {args.requests} requests x {args.max_new_tokens} new tokens")
    for column in ("run", "generation s", "tokens/s", "vs one process", "replica start s"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, row in rows.items():
        table.add_row(name, f"{row['seconds']:.2f}", f"{row['tokens_per_second']:.1f}",
                      f"{row['speedup']:.2f}x", f"{row['startup_seconds']:.2f}")  # fmt: skip
    table.caption = f"Ray overhead per request: {overhead_ms:.2f} ms; outputs equal (sorted by id): {same}"
    Console().print(table)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__, "ray": ray.__version__}  # fmt: skip
    settings = {"requests": args.requests, "max_new_tokens": args.max_new_tokens,
                "batch_size": args.batch_size, "model": Path(source).name, "layers": args.layers,
                "rounds": args.rounds}  # fmt: skip
    result = {"machine": machine, "settings": settings, "runs": rows, "all_rounds": runs,
              "overhead_ms_per_request": overhead_ms, "outputs_equal": same}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
