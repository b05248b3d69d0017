"""The floors hold: import-linter's contracts (pyproject.toml) over the package as it installs.

The four plugin folders beside `flowmoe/` install inside the `flowmoe` namespace (setuptools
`package-dir`), so the import graph is read from a staged copy laid out as pip installs it,
not from the source tree, where `flowmoe.schedulers` has no folder of its own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def stage_package(dest: Path) -> Path:
    """Copy every package listed in pyproject.toml to where it installs; return the folder to import from."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setup["package-dir"]
    for package in setup["packages"]:
        owner = max((name for name in mapped if package == name or package.startswith(name + ".")), key=len)
        source = ROOT / mapped[owner] / Path(*package.split(".")[len(owner.split(".")) :])
        target = dest / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    return dest


def lint_imports(staged: Path) -> subprocess.CompletedProcess[str]:
    linter = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run(
        [linter, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=staged,
        env={"PYTHONPATH": str(staged), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    return stage_package(tmp_path / "site")


def test_contracts_hold(staged: Path) -> None:
    result = lint_imports(staged)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
    assert "flowmoe/schedulers/cgopipe.py" in str(sorted(p.relative_to(staged) for p in staged.rglob("*.py")))


@pytest.mark.parametrize(
    ("module", "source", "contract"),
    [
        ("flowmoe/kernels/_upward.py", "from flowmoe.cli import main\n", "Floors"),
        ("flowmoe/jobs/_upward.py", "import flowmoe.runtime.runner\n", "Floors"),
        ("flowmoe/schedulers/_tensor.py", "import torch\n", "Schedulers are pure Python"),
        ("flowmoe/model/_sideways.py", "from flowmoe.schedulers import registry\n", "independent"),
        ("flowmoe/core/_ui.py", "\n\nimport rich\n", "Only the command line"),
    ],
)
def test_a_violation_fails_naming_the_line(staged: Path, module: str, source: str, contract: str) -> None:
    path = staged / module
    path.write_text(source)
    result = lint_imports(staged)
    assert result.returncode == 1, result.stdout + result.stderr
    dotted = ".".join(path.relative_to(staged).with_suffix("").parts)
    line = source[: source.index("import")].count("\n") + 1
    assert f"{dotted} -> " in result.stdout and f"(l.{line})" in result.stdout, result.stdout
    assert contract in result.stdout
    assert "BROKEN" in result.stdout
