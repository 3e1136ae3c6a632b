"""The linter's rules (pyproject.toml, [tool.ruff]) hold on the whole checkout: CI runs this test."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check reported:\n{done.stdout}{done.stderr}"
