"""Bad input to the command line itself: flags out of range, unknown flags, signals, a trace that
cannot be written, broken or faulty scheduler plugins, a GPU profile without a GPU. Each ends with
exit 2 (130/143 for a signal) and one `flowmoe: error:` line naming what is wrong, no traceback."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from attrs import frozen

from flowmoe import __version__
from flowmoe.cli import main
from flowmoe.cli import run as run_command
from flowmoe.cli.signals import Interrupted, SignalGate
from flowmoe.cli.ui import out
from flowmoe.core.errors import ConfigError
from flowmoe.core.presets import PRESETS, preset
from flowmoe.core.scheduling import Residency, SchedulerContext, StepShape
from flowmoe.core.write_guard import Guard
from flowmoe.schedulers import registry
from flowmoe.schedulers.eager import EagerScheduler
from flowmoe.schedulers.shared_options import check_pages
from flowmoe.traces.chrome import CHROME_TRACE, validate_chrome

ROOT = Path(__file__).parent.parent.parent
PROMPTS = ROOT / "examples" / "prompts.jsonl"
RUN = ["run", "--prompts", str(PROMPTS), "--output", "never-written.jsonl"]
PLAN = ["plan", "--model", "olmoe-1b-7b"]

# argv -> (the flag named, the allowed range the message states)
BAD_FLAGS = [
    ([*RUN, "--group-size", "-1"], "--group-size", "an integer >= 0"),
    ([*RUN, "--micro-batches", "0"], "--micro-batches", "an integer >= 1"),
    ([*RUN, "--gpu-memory", ""], "--gpu-memory", "more than 0 bytes"),
    ([*RUN, "--gpu-memory=-5GiB"], "--gpu-memory", "more than 0 bytes"),
    ([*RUN, "--gpu-memory", "lots"], "--gpu-memory", "a size such as 16GiB"),
    ([*RUN, "--cpu-threads", "-1"], "--cpu-threads", "an integer >= 1"),
    ([*RUN, "--expert-cache-slots", "0"], "--expert-cache-slots", "an integer >= 1"),
    ([*RUN, "--expert-cache-slots", "-1"], "--expert-cache-slots", "an integer >= 1"),
    ([*RUN, "--cache-ways", "0"], "--cache-ways", "an integer >= 1"),
    ([*RUN, "--hot-experts", "-2"], "--hot-experts", "an integer >= 0"),
    ([*RUN, "--weights-gpu-share", "1.5"], "--weights-gpu-share", "a number in [0, 1]"),
    ([*RUN, "--kv-gpu-share", "nan"], "--kv-gpu-share", "a number in [0, 1]"),
    ([*RUN, "--scheduler", "cgopipe", "--page-size", "0B"], "--page-size", "more than 0 bytes"),
    ([*RUN, "--max-new-tokens", "0"], "--max-new-tokens", "an integer >= 1"),
    ([*RUN, "--max-new-tokens", "-1"], "--max-new-tokens", "an integer >= 1"),
    ([*RUN, "--max-new-tokens", "many"], "--max-new-tokens", "an integer >= 1"),
    ([*RUN, "--batch-size", "0"], "--batch-size", "an integer >= 1"),
    ([*RUN, "--top-p", "0"], "--top-p", "a number in (0, 1]"),
    ([*RUN, "--top-p", "1.5"], "--top-p", "a number in (0, 1]"),
    ([*RUN, "--temperature", "-1"], "--temperature", "a number >= 0"),
    ([*RUN, "--temperature", "inf"], "--temperature", "a number >= 0"),
    ([*RUN, "--top-k", "-1"], "--top-k", "an integer >= 0"),
    ([*RUN, "--layers", "0"], "--layers", "an integer >= 1"),
    ([*RUN, "--kv-budget", "0"], "--kv-budget", "tokens (an integer >= 1) or a size"),
    ([*RUN, "--kv-budget=-3MiB"], "--kv-budget", "tokens (an integer >= 1) or a size"),
    ([*RUN, "--trace", "."], "--trace", "a file path in an existing, writable folder"),
    ([*RUN, "--trace", "no/such/folder/t.json"], "--trace", "folder 'no/such/folder' does not exist"),
    ([*RUN, "--record-routing", "."], "--record-routing", "a file path"),
    ([*PLAN, "--max-batch", "0"], "--max-batch", "an integer >= 1"),
    ([*PLAN, "--layers", "-2"], "--layers", "an integer >= 1"),
    ([*PLAN, "--gen-len", "0"], "--gen-len", "an integer >= 1"),
    ([*PLAN, "--plot", "."], "--plot", "a file path"),
    (["calibrate", "--threads", "0"], "--threads", "an integer >= 1"),
    (["calibrate", "--output", "."], "--output", "a file path"),
]


def _one_error(err: str) -> str:
    """The one error line; the rest of stderr is usage, with no blank line and no traceback."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert "" not in [line.strip() for line in lines], err
    errors = [line for line in lines if line.startswith("flowmoe: error: ")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(("argv", "flag", "allowed"), BAD_FLAGS)
def test_bad_flag_values_are_refused_as_they_are_parsed(
    argv: list[str], flag: str, allowed: str, capsys: pytest.CaptureFixture, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error(captured.err)
    named = re.search(rf"argument (-[a-z]/)?{flag}: must be ", line)  # -n/--max-new-tokens: a short flag too
    assert named and allowed in line, line
    assert captured.out == "" and list(tmp_path.iterdir()) == []  # nothing ran, nothing written


@pytest.mark.parametrize(
    ("argv", "flag", "allowed"),
    [
        (["run"], "--group-size", "an integer >= 0"),
        (["run"], "--weights-gpu-share", "a number in [0, 1]"),
        (["run"], "--page-size", "more than 0 bytes"),
        (["run"], "--top-p", "a number in (0, 1]"),
        (["plan"], "--max-batch", "an integer >= 1"),
        (["calibrate"], "--threads", "an integer >= 1"),
    ],
)
def test_help_shows_each_flags_range(
    argv: list[str], flag: str, allowed: str, capsys: pytest.CaptureFixture
) -> None:
    assert main([*argv, "--help"]) == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entry = re.search(rf"^  {flag} .*?(?=^  -|\Z)", options, re.M | re.S)
    assert entry and allowed in " ".join(entry.group(0).split()), options  # help wraps lines


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        ([*RUN, "--bogus"], "usage: flowmoe run "),
        ([*PLAN, "--nope", "3"], "usage: flowmoe plan "),
        (["trace", "summarize", "t.json", "--extra"], "usage: flowmoe trace summarize "),
        (["--bogus", "schedulers"], "usage: flowmoe schedulers"),
    ],
)
def test_an_unknown_flag_shows_the_subcommands_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "unrecognized arguments: " in _one_error(err)


def test_version_and_verbose_help(capsys: pytest.CaptureFixture) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flowmoe {__version__}"
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    verbose = next(line for line in help_text.splitlines() if "--verbose" in line)
    assert verbose.split("--verbose", 1)[1].strip(), "-v has no help text"
    assert main(["-v", "presets"]) == 0
    assert "[debug    ] command" in capsys.readouterr().err  # and it does what it says


@pytest.mark.parametrize("width", [80, 50])
def test_tables_never_cut_names(
    width: int, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flowmoe schedulers` and `presets` piped at 80 columns (and narrower): every name whole."""
    monkeypatch.setattr(out, "_width", width)
    assert main(["schedulers"]) == 0
    assert main(["presets"]) == 0
    text = capsys.readouterr().out
    assert "…" not in text
    cells = {cell.strip() for line in text.splitlines() for cell in re.split(r"[│┃]|\s{2,}", line)}
    assert set(registry.names()) | set(PRESETS) <= cells


def test_pages_per_expert_are_bounded() -> None:
    """A page size that would cut each expert into more than 256 copy nodes is refused, with a
    page size that fits (a Mixtral-8x7B expert is 336 MiB: 64 KiB pages would make 5376)."""
    spec = preset("mixtral-8x7b")
    message = r"--page-size 64KiB cuts each expert \(336.00 MiB\) into 5376 pages; at most 256 are allowed"
    with pytest.raises(ConfigError, match=rf"{message}: use --page-size 1344KiB or more"):
        check_pages(64 * 2**10, spec)
    check_pages(1344 * 2**10, spec)  # the size it suggests: 256 pages
    with pytest.raises(ConfigError, match="into 257 pages"):
        check_pages(1344 * 2**10 - 1, spec)


def test_scheduler_reports_print_counts_as_integers() -> None:
    figures = run_command.figures({"hits": 2490.0, "misses": 12.0, "hit_rate": 0.99522})
    assert figures == "hits 2490, misses 12, hit_rate 0.995"


def test_calibrate_without_a_gpu_refuses_the_gpu_part(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "hw.json"
    assert main(["calibrate", "--quick", "--output", str(path)]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "no GPU" in line and "--device cpu" in line
    assert not path.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "summarize", "."], ".: a folder, not a trace file"),
        (["trace", "summarize", "missing.json"], "missing.json: no such file"),
        ([*RUN, "--stop", ""], "--stop must not be empty"),
        ([*RUN, "--scheduler", "nope"], "unknown scheduler 'nope'; available: accelerate, cgopipe, cpu, "),
    ],
)
def test_other_one_line_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert _one_error(capsys.readouterr().err).startswith(f"flowmoe: error: {message}")
    assert list(tmp_path.iterdir()) == []


def _job(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--prompts", str(PROMPTS), "--output", str(tmp_path / "out.jsonl"),
            "--max-new-tokens", "2", *extra]  # fmt: skip


def test_a_failed_trace_write_after_the_job_reports_the_job_then_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(path: Path, _traces: list, guard: Guard) -> Path:  # the guard's write, the disk full
        def no_space(_tmp: Path) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return guard.write(path, CHROME_TRACE, no_space)

    monkeypatch.setattr(run_command, "write_chrome", disk_full)
    assert main(_job(tmp_path, "--trace", str(tmp_path / "t.json"))) == 2
    err = capsys.readouterr().err
    line = _one_error(err)
    assert line == f"flowmoe: error: --trace {tmp_path / 't.json'}: no space left on the disk"
    assert err.index("flowmoe run") < err.index(line)  # the summary table came first
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4  # the job's results are all there


# --- scheduler plugins ------------------------------------------------------------------------


class NoSummary(EagerScheduler):
    name = "no-summary"
    summary = None


class RaisesInInit(EagerScheduler):
    name = "raises-in-init"

    def __init__(self, context: SchedulerContext) -> None:
        raise RuntimeError("cannot start")


class PlanReturnsNone(EagerScheduler):
    name = "plan-none"

    def plan(self, step: StepShape) -> None:  # type: ignore[override]
        return None


class EmptyPlan(EagerScheduler):
    name = "empty-plan"

    def plan(self, step: StepShape):  # type: ignore[override]
        yield from ()


class YieldsJunk(EagerScheduler):
    name = "yields-junk"

    def plan(self, step: StepShape):  # type: ignore[override]
        yield "a node, honest"


class FailsMidPlan(EagerScheduler):
    name = "fails-mid-plan"

    def plan(self, step: StepShape):  # type: ignore[override]
        for i, item in enumerate(super().plan(step)):
            if i == 3:
                raise KeyError("layer")
            yield item


class BadResidency(EagerScheduler):
    name = "bad-residency"

    def residency(self) -> Residency:
        return Residency(frozenset({0}), frozenset({(0, 999)}))


class NegativeBuffer(EagerScheduler):
    name = "negative-buffer"

    def weight_buffer_bytes(self) -> int:
        return -1


@frozen
class PlainOptions:
    width: int = 1  # not made with flowmoe.core.options.option: no flag, range or help


class BadOptions(EagerScheduler):
    name = "bad-options"
    Options = PlainOptions


PLUGINS = {
    "missing-package": "no_such_flowmoe_plugin:Scheduler",
    "not-a-class": f"{__name__}:PLUGINS",
    **{cls.name: f"{__name__}:{cls.__name__}" for cls in
       (NoSummary, RaisesInInit, PlanReturnsNone, EmptyPlan, YieldsJunk, FailsMidPlan, BadResidency,
        NegativeBuffer, BadOptions)},
}  # fmt: skip


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    found = [EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in PLUGINS.items()]
    monkeypatch.setattr(
        registry, "entry_points", lambda group: found if group == registry.ENTRY_POINT_GROUP else []
    )
    yield


def test_broken_plugins_are_listed_and_break_nothing_else(
    plugins: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert registry.names()[-len(PLUGINS) :] == list(PLUGINS)  # listed without importing any
    assert main(["schedulers"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "missing-package broken: scheduler plugin 'missing-package'" in text
    assert "ModuleNotFoundError" in text and "has no `summary`" in text
    assert main(_job(tmp_path, "--scheduler", "eager")) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing-package", "scheduler plugin 'missing-package' (no_such_flowmoe_plugin:Scheduler) failed "
                            "to load: ModuleNotFoundError"),
        ("not-a-class", "scheduler plugin 'not-a-class' (tests.bad_inputs.test_cli:PLUGINS) is a dict, not a "
                        "scheduler class"),
        ("no-summary", "scheduler plugin 'no-summary' (tests.bad_inputs.test_cli:NoSummary) has no "
                       "`summary`"),
        ("raises-in-init", "scheduler 'raises-in-init' failed to start: RuntimeError: cannot start"),
        ("bad-residency", "scheduler 'bad-residency': its residency names expert (0, 999)"),
        ("negative-buffer", "scheduler 'negative-buffer': weight_buffer_bytes() is -1, not a byte count"),
        ("bad-options", "scheduler plugin 'bad-options' (tests.bad_inputs.test_cli:BadOptions) has unusable "
                        "Options: options class PlainOptions: field width has no Knob"),
        ("plan-none", "scheduler 'plan-none': plan() returned NoneType, not a generator of TaskNodes"),
        ("empty-plan", "scheduler 'empty-plan' planned no node for step 0"),
        ("yields-junk", "scheduler 'yields-junk' yielded a str, neither a TaskNode nor a RoutingRequest"),
        ("fails-mid-plan", "scheduler 'fails-mid-plan' failed to plan step 0: KeyError: 'layer'"),
    ],
)  # fmt: skip
def test_a_faulty_plugin_fails_its_run_in_one_line(
    plugins: None, name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(_job(tmp_path, "--scheduler", name)) == 2
    line = _one_error(capsys.readouterr().err)
    assert line.startswith(f"flowmoe: error: {message}"), line
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


# --- signals ----------------------------------------------------------------------------------


def _caught(pid: int) -> int:
    """The signals a process catches (bit n-1 for signal n), from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)


def _start(args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "flowmoe.cli", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_ctrl_c_while_flowmoe_starts_ends_in_one_message(tmp_path: Path) -> None:
    """SIGINT the moment the handlers are in (flowmoe still importing torch): 130, one message."""
    proc = _start(_job(tmp_path, "--trace", str(tmp_path / "t.json")))
    deadline = time.time() + 30
    while proc.poll() is None and not _caught(proc.pid) & (1 << (signal.SIGTERM - 1)):
        assert time.time() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert err.decode().strip() == "flowmoe: interrupted; results written so far are kept"


def test_a_second_signal_waits_for_the_cleanup_of_the_first() -> None:
    gate = SignalGate()
    with gate.installed(), pytest.raises(Interrupted) as caught, gate.armed():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # during the cleanup: only noted
            time.sleep(0.01)
    assert caught.value.exit_code == 143 and gate.noted == signal.SIGINT


def test_an_interrupt_python_drops_is_raised_again() -> None:
    """A signal whose exception is raised inside a weakref callback (or a __del__), where Python only
    prints "Exception ignored", still ends the command: it is raised again outside that callback."""

    class Dying:
        pass

    gate = SignalGate()
    with gate.installed(), pytest.raises(Interrupted) as caught, gate.armed():
        dying = Dying()
        alive = weakref.ref(dying, lambda _: gate.handle(signal.SIGTERM, None))  # raises in the callback
        del dying  # the callback runs here; its exception is dropped
        assert alive() is None
        time.sleep(5)  # raised again in here
    assert caught.value.exit_code == 143


def test_sigterm_during_a_job_keeps_a_valid_trace(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": "x" * (20 + i)}) + "\n" for i in range(64)))
    trace, output = tmp_path / "t.json", tmp_path / "o.jsonl"
    proc = _start(["run", "--prompts", str(prompts), "--output", str(output), "--max-new-tokens", "200",
                   "--batch-size", "4", "--trace", str(trace)])  # fmt: skip
    deadline = time.time() + 60
    while proc.poll() is None and not (output.exists() and output.read_text().count("\n") >= 1):
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert err.decode().count("flowmoe: interrupted; results written so far are kept") == 1
    assert "Traceback" not in err.decode()
    data = json.loads(trace.read_text())
    assert validate_chrome(data) == [] and any(e["ph"] == "X" for e in data["traceEvents"])
    assert all(json.loads(line)["id"] is not None for line in output.read_text().splitlines())


# --- the README tour --------------------------------------------------------------------------

CHEAP = ("flowmoe schedulers", "flowmoe presets", "flowmoe run ", "flowmoe trace summarize ", "flowmoe plan ")


def _tour() -> list[str]:
    """The tour's commands, continuation lines joined, comments dropped."""
    block = (ROOT / "README.md").read_text().split("## A tour", 1)[1].split("```bash\n", 1)[1]
    block = block.split("```", 1)[0].replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_tour_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The tour's cheap commands (no download, no GPU, no paper-scale simulation), copied as
    written into a fresh folder holding the repository's examples, all succeed."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "prompts.jsonl").write_bytes(PROMPTS.read_bytes())
    monkeypatch.chdir(tmp_path)
    commands = _tour()
    assert commands[0] == "source .venv/bin/activate"
    home = os.environ["FLOWMOE_HOME"]
    ran = []
    for command in commands:
        if not command.startswith(CHEAP) or "checkpoints/" in command:
            continue
        command = command.replace("${FLOWMOE_HOME:-$HOME/.cache/flowmoe}", home)
        argv = [a.strip('"') for a in command.split()][1:]
        assert main(argv) == 0, command
        ran.append(argv[0])
    assert ran == ["schedulers", "presets", "run", "run", "trace", "plan"]
    assert "Traceback" not in capsys.readouterr().err
