"""`mypy` over titanrl/ (settings in pyproject.toml's [tool.mypy]): part of the README's test
command, so CI type-checks the package with the suite."""

import importlib.util
import sys

import pytest
from helpers import background

# This interpreter's mypy: it reads the installed torch and extras that titanrl imports. It runs
# in the background from collection on (helpers/background.py).
background.register("mypy", ("tests/test_types.py::test_mypy",), lambda folder: [sys.executable, "-m", "mypy"])


def test_mypy():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: pip install -e '.[dev]'")
    proc, _ = background.result("mypy")
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"
