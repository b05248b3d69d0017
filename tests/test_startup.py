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


SMALL = ["--model", "olmoe-1b-7b", "--layers", "1", "--workload", "fixed:8:2", "--hardware", "t4"]
COMMANDS = [
    ["--version"], ["--help"], ["presets"], ["schedulers"], ["simulate", "--help"], ["run", "--help"],
    ["plan", "--model", "mixtral-8x7b", "--hardware", "t4"], ["simulate", *SMALL, "--scheduler", "eager"],
]  # fmt: skip


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv))
def test_commands_without_tensors_do_not_import_torch(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    last = done.stdout.strip().splitlines()[-1]
    assert last == "NO-TORCH 0", (last, done.stderr[-2000:])
