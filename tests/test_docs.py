"""The docs a newcomer reads: a short README, a configuration page that matches the code, and no
dates or lab notes outside CHANGELOG.md and the benchmark JSONs."""

import pathlib
import re
import subprocess
import sys

from helpers.launch import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)


def test_readme_is_short():
    assert (ROOT / "README.md").read_text().count("\n") <= 250


def test_configuration_page_is_generated_from_the_code():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_config_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_no_dates_outside_changelog_and_benchmarks():
    pattern = re.compile(r"\b20[2-3][0-9]-[01][0-9]-[0-3][0-9]\b")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    offenders = []
    for name in tracked:
        if name == "CHANGELOG.md" or name.startswith("benchmarks/") or not name.endswith((".py", ".md", ".toml")):
            continue
        path = ROOT / name
        if path.exists():
            offenders += [
                f"{name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)
            ]
    assert not offenders, offenders


def test_relative_links_in_docs_resolve():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
