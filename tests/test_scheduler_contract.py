"""Every registered scheduler computes the same function: same tokens, logits within 1e-5 of eager."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowmoe.core.errors import ConfigError
from flowmoe.model.loading import load_model
from flowmoe.schedulers.registry import available
from flowmoe.traces.chrome import chrome_trace, validate_chrome
from tests.hf_models import hf_model, save_hf
from tests.schedule_fixtures import assert_as_eager, golden_listing, run_eager, run_scheduler

SCHEDULERS = sorted(available())


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
          "llama4", "phimoe", "granitemoe", "ernie4_5_moe"]  # fmt: skip


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = save_hf(hf_model(request.param), tmp_path_factory.mktemp("contract") / request.param)
    return load_model(folder)


@pytest.fixture(scope="module")
def reference(model):
    return run_eager(model)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_same_tokens_and_logits_as_eager(model, reference, name: str) -> None:
    ours, runtime = run_scheduler(model, name)
    assert_as_eager(ours, reference)
    assert not validate_chrome(chrome_trace([runtime.trace]))


@pytest.mark.parametrize("name", SCHEDULERS)
def test_golden_node_order(name: str) -> None:
    """The per-lane node order on a tiny model and a fixed routing trace is reviewed in
    tests/golden/NAME.txt (FLOWMOE_UPDATE_GOLDEN=1 rewrites it)."""

    path = Path(__file__).parent / "golden" / f"{name}.txt"
    listing = golden_listing(name)
    if os.environ.get("FLOWMOE_UPDATE_GOLDEN"):
        path.write_text(listing)
    assert path.exists(), f"no golden snapshot for {name}: run with FLOWMOE_UPDATE_GOLDEN=1 and review {path}"
    assert listing == path.read_text()


def test_third_party_scheduler_registers_by_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A package adds a scheduler under the `flowmoe.schedulers` entry-point group; a plugin may not
    shadow a built-in name."""
    from importlib.metadata import EntryPoint

    from flowmoe.core.policy import Policy
    from flowmoe.core.scheduling import NodeFactory, SchedulerContext
    from flowmoe.core.spec import ModelSpec
    from flowmoe.schedulers import registry
    from flowmoe.schedulers.eager import EagerScheduler
    from tests.schedule_fixtures import TINY_CONFIG

    class Mine(EagerScheduler):
        name = "mine"

    found = [
        EntryPoint("mine", f"{__name__}:Mine", registry.ENTRY_POINT_GROUP),
        EntryPoint("eager", f"{__name__}:Mine", registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setitem(globals(), "Mine", Mine)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: found if group == registry.ENTRY_POINT_GROUP else []
    )
    assert registry.available()["mine"] is Mine
    assert registry.available()["eager"] is EagerScheduler
    spec = ModelSpec.from_hf(TINY_CONFIG)
    assert isinstance(registry.create("mine", SchedulerContext(spec, Policy(), NodeFactory(spec))), Mine)
    with pytest.raises(ConfigError, match=r"unknown scheduler 'nope'; available: .*mine"):
        registry.create("nope", SchedulerContext(spec, Policy(), NodeFactory(spec)))
