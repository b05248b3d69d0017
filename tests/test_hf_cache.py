"""`--model org/name` from the local Hugging Face cache (issue 27, item 8): huggingface_hub's layout,
fabricated here; nothing touches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flowmoe.cli import main
from flowmoe.core.errors import ConfigError
from flowmoe.core.hf_cache import hub_cache, resolve_model
from flowmoe.model.builtin import ensure_builtin

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _cache(root: Path, repo: str = "acme/tiny-moe", refs: dict[str, str] | None = None) -> Path:
    """A cache holding the built-in model as `repo` at COMMIT (refs/main) and OTHER (refs/v1)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    for commit in (COMMIT, OTHER):
        shutil.copytree(ensure_builtin(), folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    for name, commit in (refs if refs is not None else {"main": COMMIT, "v1": OTHER}).items():
        (folder / "refs" / name).write_text(commit)  # huggingface_hub writes no newline
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.chdir(tmp_path)
    return _cache(root)


def test_cache_folder_as_huggingface_hub_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache() == tmp_path / "hub"


def test_repo_id_resolves_to_the_snapshot_refs_main_names(cache: Path) -> None:
    assert resolve_model("acme/tiny-moe") == str(cache / "snapshots" / COMMIT)
    assert resolve_model("acme/tiny-moe@v1") == str(cache / "snapshots" / OTHER)
    assert resolve_model(f"acme/tiny-moe@{OTHER}") == str(cache / "snapshots" / OTHER)


def test_paths_and_presets_are_left_alone(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "acme" / "tiny-moe").mkdir(parents=True)  # a folder of that name wins (cwd is tmp_path)
    assert resolve_model("acme/tiny-moe") == "acme/tiny-moe"
    for source in ("mixtral-8x7b", "/abs/path", "a/b/c", "./x/y"):
        assert resolve_model(source) == source


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("acme/other", "not in the Hugging Face cache"),
        ("acme/tiny-moe@v2", "revision v2 is not in the Hugging Face cache"),
        ("acme/tiny-moe@../x", "not a path"),
    ],
)
def test_missing_is_one_line_saying_how_to_fetch(cache: Path, source: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        resolve_model(source)
    assert "hf download" in str(err.value) or "not a path" in str(err.value)


def test_partial_download_is_named(cache: Path) -> None:
    (cache / "snapshots" / COMMIT / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model("acme/tiny-moe")


def test_run_takes_a_cached_repo_id(cache: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hello"}\n')
    out = tmp_path / "o.jsonl"
    argv = ["run", "--model", "acme/tiny-moe", "--prompts", str(prompts), "--output", str(out)]
    assert main([*argv, "--max-new-tokens", "2"]) == 0
    assert len(json.loads(out.read_text())["output_ids"]) <= 2


def test_run_names_a_repo_missing_from_the_cache(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--model", "acme/absent", "--prompts", "p.jsonl", "--output", "o.jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "acme/absent" in err and "hf download acme/absent" in err and "Traceback" not in err


def test_plan_takes_a_cached_repo_id(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "acme/tiny-moe", "--hardware", "T4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-moe"  # the repo's name, not the commit
