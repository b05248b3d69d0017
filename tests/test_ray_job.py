"""One job over two replicas on a local Ray cluster (2 CPUs, started once for the module) writes
what a single-process run writes, compared line by line after sorting by id (results are appended
as they finish, so the file order depends on which replica finishes first): uninterrupted, after
a SIGKILL of the driver and a re-run, and with a replica killed mid-job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'flowmoe[ray]')")

from flowmoe.cli import main  # noqa: E402
from flowmoe.cluster.ray_job import ClusterProgress, actor_name, check_reachable, run_on_cluster  # noqa: E402
from flowmoe.cluster.replica import ReplicaConfig  # noqa: E402
from flowmoe.cluster.resources import ReplicaResources  # noqa: E402
from flowmoe.core.errors import FlowmoeError  # noqa: E402
from flowmoe.core.policy import Policy  # noqa: E402
from flowmoe.jobs.job import JobSpec  # noqa: E402
from flowmoe.jobs.sampling import SamplingParams  # noqa: E402
from flowmoe.model.builtin import ensure_builtin  # noqa: E402
from tests.test_job_resume import WORDS  # noqa: E402

PROMPTS = 60
SAMPLING = ["--temperature", "0.8", "--top-k", "40", "--seed", "11"]
SHAPE = ["--batch-size", "8", "--micro-batches", "2", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray cluster of 2 CPUs for the module; its address for drivers in other processes."""
    with warnings.catch_warnings():  # Ray's note on a future default of CUDA_VISIBLE_DEVICES
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _prompt_file(path: Path) -> Path:
    """60 prompts of mixed lengths, text and token ids, string and integer ids."""
    rows = []
    for i in range(PROMPTS):
        if i % 3 == 0:
            rows.append({"id": i, "input_ids": [3 + (i * 7 + k * 13) % 250 for k in range(1 + i % 25)]})
        else:
            rows.append(
                {"id": f"p{i}", "prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 9))}
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _args(prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--output", str(out), *SHAPE, *SAMPLING, *extra]


def _sorted_lines(path: Path) -> list[str]:
    """The file's lines sorted by id, each whole and valid, no id twice."""
    data = path.read_text()
    assert data.endswith("\n"), "torn last line"
    lines = data.splitlines()
    ids = [json.dumps(json.loads(line)["id"]) for line in lines]
    assert len(ids) == len(set(ids)), "duplicate results"
    return [line for _, line in sorted(zip(ids, lines, strict=True))]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The prompt file and the sorted lines of an uninterrupted single-process run."""
    folder = tmp_path_factory.mktemp("ray-job")
    prompts = _prompt_file(folder / "prompts.jsonl")
    out = folder / "single.jsonl"
    assert main(_args(prompts, out)) == 0
    return prompts, _sorted_lines(out)


def test_two_replicas_equal_one_process(cluster: str, job, tmp_path: Path) -> None:
    prompts, reference = job
    assert len(reference) == PROMPTS
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.json"
    assert main(_args(prompts, out, "--ray", cluster, "--replicas", "2", "--trace", str(trace))) == 0
    assert _sorted_lines(out) == reference
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    ranked = [names[pid] for pid in sorted(names, key=order.__getitem__)]
    assert ranked.index("replica 0: cpu") < ranked.index("replica 1: gpu")
    busy = {names[e["pid"]].split(":")[0] for e in events if e["ph"] == "X"}
    assert busy == {"replica 0", "replica 1"}  # both replicas ran nodes, each in its own processes
    assert not list(tmp_path.glob(".out.jsonl.lock"))  # the driver's lock sidecar is gone


def _interrupt(args: list[str], out: Path, at_lines: int, sig: signal.Signals) -> tuple[int, str]:
    """Run the command in a subprocess; send `sig` once the output holds `at_lines` lines."""
    process = subprocess.Popen([sys.executable, "-m", "flowmoe.cli", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        while process.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < at_lines):
            time.sleep(0.002)
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        os.kill(process.pid, sig)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err.decode()


def test_replicas_keep_the_expert_format_as_one_process_does(cluster: str, job, tmp_path: Path) -> None:
    """Each replica loads its experts packed (int4, quantized as each layer is read), as a
    single-process run does: the same lines."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(job[0].read_text().splitlines(keepends=True)[:16]))  # a chunk per replica
    lines = {}
    for name, extra in (("single", ()), ("ray", ("--ray", cluster, "--replicas", "2"))):
        out = tmp_path / f"{name}.jsonl"
        assert main(_args(prompts, out, "--expert-format", "int4", *extra)) == 0
        lines[name] = _sorted_lines(out)
    assert len(lines["ray"]) == 16 and lines["ray"] == lines["single"]


def test_driver_stopped_or_killed_then_resumed(cluster: str, job, tmp_path: Path) -> None:
    prompts, reference = job
    out = tmp_path / "out.jsonl"
    args = _args(prompts, out, "--ray", cluster, "--replicas", "2")
    code, err = _interrupt(args, out, 10, signal.SIGTERM)  # Ray's own SIGTERM handler would abort
    assert code == 143 and "interrupted; results written so far are kept" in err
    stopped = out.read_bytes().count(b"\n")
    assert set(_sorted_lines(out)) <= set(reference)  # whole lines, each the reference's
    code, _ = _interrupt(args, out, stopped + 10, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert stopped + 10 <= out.read_bytes().count(b"\n") < PROMPTS
    with out.open("ab") as handle:  # as if the kill had landed in the middle of a write
        handle.write(b'{"id": "p59", "output_ids": [4, 5')
    assert main(args) == 0
    assert _sorted_lines(out) == reference


def test_killed_replica_is_restarted_and_its_requests_rerun(cluster: str, job, tmp_path: Path) -> None:
    prompts, reference = job
    out = tmp_path / "out.jsonl"
    # half the reference's batch: a chunk (8 requests) is two waves of 4, so the kill after the
    # first result lands while the second wave is still generating (and the tokens do not depend
    # on the batch, only on each request's seed)
    spec = JobSpec(prompts, out, max_new_tokens=8, sampling=SamplingParams(0.8, 1.0, 40, 11),
                   batch_size=4, micro_batches=2)  # fmt: skip
    policy = Policy(micro_batch_size=2, micro_batches=2)
    config = ReplicaConfig(str(ensure_builtin()), None, None, "eager", policy, spec)
    killed = []

    def finished(replica: int) -> None:
        if replica == 1 and not killed:  # Ray restarts it; its chunk's unfinished requests run again
            killed.append(ray.get_actor(actor_name(str(out), 1)))
            ray.kill(killed[0], no_restart=False)

    progress = ClusterProgress(finished=finished)
    report = asyncio.run(run_on_cluster(config, 2, ReplicaResources(1, 0), cluster, progress))
    assert report.replicas[1].restarts == 1 and report.requeued > 0
    assert report.requests == PROMPTS and sum(r.results for r in report.replicas) == PROMPTS
    assert _sorted_lines(out) == reference


def test_replicas_that_do_not_fit_are_refused(cluster: str, job, tmp_path: Path, capsys) -> None:
    prompts, _ = job
    out = tmp_path / "out.jsonl"
    assert main(_args(prompts, out, "--ray", cluster, "--replicas", "2", "--replica-cpus", "2")) == 2
    err = capsys.readouterr().err
    assert "flowmoe: error: --replicas 2: each replica asks for 2 CPU(s) and 0 GPU(s)" in err
    assert "holds only 1" in err and "Traceback" not in err
    assert not out.exists()  # refused before the output was opened
    assert main(_args(prompts, out, "--replicas", "2")) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err


def test_an_address_without_a_cluster_is_refused_at_once() -> None:
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(FlowmoeError, match=f"--ray 127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}")


def test_replicas_are_counted_node_by_node() -> None:
    """A replica needs its whole request on one node: 4 GPU replicas of 4 CPUs fit a 16-CPU, 4-GPU
    node 4 times and an 8-CPU, 8-GPU node twice (CPUs run out first), 6 in all."""
    nodes = [{"CPU": 16.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 8.0}]
    each = ReplicaResources.choose("auto", 4, nodes)
    assert (each.num_gpus, each.device) == (1, "cuda")
    assert [each.per_node(n) for n in nodes] == [4, 2]
    each.check_fit(6, nodes, "at head:6379")
    with pytest.raises(FlowmoeError, match=r"--replicas 7: .* 4 CPU\(s\) and 1 GPU\(s\), .* holds only 6"):
        each.check_fit(7, nodes, "at head:6379")
    assert ReplicaResources.choose("cpu", 2, nodes).device == "cpu"
    assert ReplicaResources.choose("auto", 1, [{"CPU": 2.0}]) == ReplicaResources(1, 0)


def test_without_ray_the_flag_says_how_to_install_it(job, tmp_path: Path, monkeypatch, capsys) -> None:
    prompts, _ = job
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    for name in [m for m in sys.modules if m.startswith("flowmoe.cluster.")]:
        monkeypatch.delitem(sys.modules, name)
    out = tmp_path / "out.jsonl"
    assert main(_args(prompts, out, "--ray", "local")) == 2
    assert "flowmoe: error: --ray needs Ray: pip install 'flowmoe[ray]'" in capsys.readouterr().err
    assert not out.exists()
