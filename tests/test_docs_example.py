"""The third-party scheduler in docs/architecture.md is real: registered by entry point, it runs and
gives eager's tokens."""

from __future__ import annotations

import re
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from flowmoe.model.loading import load_model
from flowmoe.schedulers import registry
from tests.schedule_fixtures import run_eager, run_scheduler

DOC = Path(__file__).parent.parent / "docs" / "architecture.md"


def test_documented_scheduler_runs_and_matches_eager(
    mixtral_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = re.search(r"```python\n(# my_sched/__init__.py\n.*?)```", DOC.read_text(), re.S)
    assert source, "docs/architecture.md lost its scheduler example"
    module = types.ModuleType("my_sched")
    exec(compile(source.group(1), str(DOC), "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "my_sched", module)
    entry = EntryPoint("all-resident", "my_sched:AllResident", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [entry] if group == registry.ENTRY_POINT_GROUP else []
    )
    model = load_model(mixtral_folder)
    (results, _), runtime = run_scheduler(model, "all-resident")
    assert runtime.trace.spans, "the plugin ran no node"
    assert [r.output_ids for r in results] == [r.output_ids for r in run_eager(model)[0]]
