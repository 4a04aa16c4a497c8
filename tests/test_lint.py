"""`ruff check` and `ruff format --check` over the repository (rules in pyproject.toml): part of
the README's test command, so CI runs them with the suite."""

import pathlib
import shutil
import subprocess

import pytest
from helpers.launch import REPO_ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    ruff = shutil.which("ruff") or pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    proc = subprocess.run([ruff, *command, "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(command)} failed:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_no_line_over_120_characters_in_the_package():
    package = pathlib.Path(REPO_ROOT) / "titanrl"
    too_long = [
        f"{path.relative_to(REPO_ROOT)}:{i}"
        for path in sorted(package.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert not too_long, too_long
