"""`mypy` over titanrl/ (settings in pyproject.toml's [tool.mypy]): part of the README's test
command, so CI type-checks the package with the suite."""

import importlib.util
import subprocess
import sys

import pytest
from helpers.launch import REPO_ROOT


def test_mypy():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: pip install -e '.[dev]'")
    # This interpreter's mypy: it reads the installed torch and extras that titanrl imports.
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"
