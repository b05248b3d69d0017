"""Commands that run no tensors start without importing torch (issue 27, item 5): torch takes
seconds to import, `flowmoe --version` should not."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
from flowmoe.cli import main
code = main(sys.argv[1:])
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["presets"], ["schedulers"], ["simulate", "--help"], ["run", "--help"]],
    ids=lambda argv: " ".join(argv),
)
def test_commands_without_tensors_do_not_import_torch(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    last = done.stdout.strip().splitlines()[-1]
    assert last == "NO-TORCH 0", (last, done.stderr[-2000:])
