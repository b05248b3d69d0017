"""The tree stays ruff clean (lint and format) and mypy clean, checked with the test suite so CI
enforces it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff(command: list[str]) -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _installed_layout(tree: Path) -> Path:
    """A link tree of the package as installed: flowmoe/ with the plugin folders mapped inside it.

    setuptools' editable install maps schedulers/, devices/, kernels/ and traces/ into the flowmoe
    namespace with an import hook mypy cannot follow, so mypy reads this tree (pyproject's package-dir,
    made of symlinks to the sources) instead. Idempotent, and safe when two runs build it at once."""
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    links = {Path(*name.split(".")): ROOT / folder for name, folder in package_dir.items() if "." in name}
    for top in (name for name in package_dir if "." not in name):
        for child in (ROOT / package_dir[top]).iterdir():
            if child.name != "__pycache__":
                links.setdefault(Path(top) / child.name, child)
    for link, target in links.items():
        path = tree / link
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() and Path(os.readlink(path)) == target:
            continue
        if path.is_symlink():
            path.unlink()
        with contextlib.suppress(FileExistsError):  # another run made it meanwhile
            path.symlink_to(target, target_is_directory=target.is_dir())
    for top in {link.parts[0] for link in links}:
        for path in (tree / top).iterdir():
            if path.is_symlink() and path.relative_to(tree) not in links:
                path.unlink()  # a module since removed from the sources
    return tree


def test_mypy() -> None:
    """mypy over flowmoe and its plugin folders, configured by pyproject's [tool.mypy]."""
    tree = _installed_layout(ROOT / "build" / "mypy")
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += ["--cache-dir", str(ROOT / "build" / "mypy-cache"), "-p", "flowmoe"]
    result = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    output = result.stdout + result.stderr
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items():
        if "." in name:  # report the sources' paths, not the link tree's
            output = output.replace(name.replace(".", "/") + "/", folder + "/")
    assert result.returncode == 0, output
