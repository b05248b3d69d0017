"""The third-party scheduler in docs/architecture.md is real: registered by entry point, it runs and
gives eager's tokens, and its knob, declared in its own file only, is a generated flag with its
range, validated, carried by the policy to the scheduler, and searched by the best-policy search."""

from __future__ import annotations

import json
import re
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.schedulers import registry
from tests.schedule_fixtures import TINY_CONFIG, run_eager, run_scheduler

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "architecture.md"
PROMPTS = ROOT / "examples" / "prompts.jsonl"


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The documented `my_sched` package, installed under the scheduler entry-point group."""
    source = re.search(r"```python\n(# my_sched/__init__.py\n.*?)```", DOC.read_text(), re.S)
    assert source, "docs/architecture.md lost its scheduler example"
    module = types.ModuleType("my_sched")
    monkeypatch.setitem(sys.modules, "my_sched", module)
    exec(compile(source.group(1), str(DOC), "exec"), module.__dict__)
    entry = EntryPoint("all-resident", "my_sched:AllResident", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [entry] if group == registry.ENTRY_POINT_GROUP else []
    )
    return module


def test_documented_scheduler_runs_and_matches_eager(mixtral_folder: Path, plugin: types.ModuleType) -> None:
    model = load_model(mixtral_folder)
    eager = [r.output_ids for r in run_eager(model)[0]]
    (results, _), runtime = run_scheduler(model, "all-resident")
    assert runtime.trace.spans, "the plugin ran no node"
    assert [r.output_ids for r in results] == eager
    # its knob, through the policy: each layer's busiest expert first, the same tokens
    busiest = Policy(micro_batch_size=3, micro_batches=2, options=(plugin.AllResidentOptions(1),))
    (results, _), runtime = run_scheduler(model, "all-resident", busiest)
    assert runtime.scheduler.options == plugin.AllResidentOptions(busiest_first=1)
    assert [r.output_ids for r in results] == eager
    layers: dict[tuple[int, int], list[TaskNode]] = {}  # (layer, mb) -> its expert nodes, as planned
    for node in sorted(
        (s.node for s in runtime.trace.spans if s.node.op is Op.EXPERT_FFN), key=lambda n: n.id
    ):
        layers.setdefault((node.layer, node.mb), []).append(node)
    assert all(nodes[0].rows == max(n.rows for n in nodes) for nodes in layers.values())


def test_documented_knob_is_a_flag_validated_carried_and_searched(
    plugin: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[object] = []
    documented_init = plugin.AllResident.__init__

    def recording(self, context) -> None:
        documented_init(self, context)
        seen.append(self.options.busiest_first)

    monkeypatch.setattr(plugin.AllResident, "__init__", recording)
    # a generated flag, its range in --help, for run, simulate and compare
    for command in ("run", "simulate", "compare"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "options of all-resident:" in text and "--busiest-first BUSIEST_FIRST" in text
        assert "(an integer >= 0; default 0)" in text
    # validated: by argparse from its range, by the class itself, and refused for another scheduler
    run = ["run", "--prompts", str(PROMPTS), "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2"]
    assert main([*run, "--scheduler", "all-resident", "--busiest-first", "-1"]) == 2
    assert "argument --busiest-first: must be an integer >= 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--busiest-first \(AllResidentOptions.busiest_first\) must be"):
        plugin.AllResidentOptions(busiest_first=-1)
    assert main([*run, "--scheduler", "eager", "--busiest-first", "2"]) == 2
    assert "--busiest-first is an option of all-resident; scheduler eager does not" in capsys.readouterr().err
    # carried by the policy from the command line to the scheduler
    assert main([*run, "--scheduler", "all-resident", "--busiest-first", "2"]) == 0
    assert seen == [2]
    capsys.readouterr()
    # searched: the best-policy search builds it at each of its candidates where the flag is not given
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
    simulate = ["simulate", "--model", str(tmp_path / "tiny"), "--workload", "fixed:6:4", "--decode-samples",
                "1", "--scheduler", "all-resident", "--batch-size", "4", "--json"]  # fmt: skip
    seen.clear()
    assert main(simulate) == 0
    assert set(seen) == {0, 2}
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["policy"]["busiest_first"] in (0, 2)
    assert main([*simulate, "--busiest-first", "1"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["policy"]["busiest_first"] == 1 and result["policy_text"].endswith("busiest_first 1")
    # and nothing of flowmoe's own names it: the knob lives in the scheduler's file only
    sources = [*ROOT.glob("flowmoe/**/*.py"), *ROOT.glob("schedulers/*.py")]
    assert not [p for p in sources if re.search("busiest.first", p.read_text())]
