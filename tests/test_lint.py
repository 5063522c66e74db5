"""ruff's lint and format checks over the repository (pyproject.toml's [tool.ruff]): part of the suite, so
`make test` and CI fail on a line over 120 characters, an unused import or an unformatted file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)} .:\n{result.stdout}{result.stderr}"
