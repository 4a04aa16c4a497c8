"""Layers import one way (CONTRIBUTING.md, "Layers"): over every import of the package, no unit
imports one above it, so the package graph has no cycle and `components/` stays infrastructure;
and no module imports itself through others (the imports that run when a module is imported,
`TYPE_CHECKING` ones included, not those inside functions)."""

import pathlib
import shutil

from helpers.layers import LAYERS, cycles, import_edges, module_edges, upward_imports

import titanrl

PACKAGE = pathlib.Path(titanrl.__file__).resolve().parent


def test_no_upward_import_and_no_cycle():
    problems = upward_imports(PACKAGE)
    assert not problems, "\n".join(problems)
    assert cycles(import_edges(PACKAGE)) == []
    units = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.name != "__init__.py"}
    assert units - {"__pycache__"} == set(LAYERS)  # every unit has its place in the order


def test_no_module_import_cycle():
    edges = module_edges(PACKAGE)
    found = cycles(edges)
    where = [", ".join(f"{a} -> {b} ({edges[a, b][0]})" for a in c for b in c if (a, b) in edges) for c in found]
    assert not found, "\n".join(where)
    assert ("titanrl.rl.partial", "titanrl.rl.rollouts") in edges  # module names, not units


def test_components_is_infrastructure_only():
    above = {"data", "generator", "rewards", "envs", "algorithms", "rl", "trainer", "recipes", "train", "cli"}
    edges = import_edges(PACKAGE)
    assert not {dst for (src, dst) in edges if src == "components"} & above


def _copy_package(tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / "titanrl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return copy


def test_the_check_catches_one_upward_import_of_any_kind(tmp_path):
    """A test of the test: one upward import added to a copy of the package - at module level,
    inside a function, or under TYPE_CHECKING - is reported with its file and line, and makes a cycle."""
    forms = {
        "module": "from titanrl.rl.rollouts import RolloutCollector\n",
        "lazy": "def _f():\n    from titanrl.recipes import get_recipe\n    return get_recipe\n",
        "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from titanrl.trainer import Trainer\n",
        "importlib": "import importlib\n_m = importlib.import_module('titanrl.algorithms')\n",
    }
    for name, code in forms.items():
        copy = _copy_package(tmp_path / name)
        assert upward_imports(copy) == []
        timer = copy / "components" / "timer.py"
        lines = timer.read_text().count("\n")
        timer.write_text(timer.read_text() + code)
        problems = upward_imports(copy)
        assert len(problems) == 1, (name, problems)
        assert problems[0].startswith("titanrl/components/timer.py:") and "components imports" in problems[0]
        assert int(problems[0].split(":")[1]) > lines
        assert cycles(import_edges(copy)), name


def test_the_module_check_catches_one_cycle_of_any_kind(tmp_path):
    """A test of the test: one import added to a copy of the package that closes a cycle of
    modules inside one unit - at module level, under TYPE_CHECKING, as a submodule named by
    `from package import name` - is reported; the same import inside a function is not."""
    forms = {
        "module": ("from titanrl.rl.partial import PartialRolloutCollector\n", True),
        "type_checking": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from titanrl.rl import partial\n",
            True,
        ),
        "relative": ("from . import partial\n", True),
        "lazy": (
            "def _f():\n    from titanrl.rl.partial import PartialRolloutCollector\n    return PartialRolloutCollector\n",
            False,
        ),
    }
    copy = _copy_package(tmp_path)
    groups = copy / "rl" / "groups.py"  # partial.py imports it
    original = groups.read_text()
    for name, (code, cyclic) in forms.items():
        groups.write_text(original + code)
        found = cycles(module_edges(copy))
        assert bool(found) == cyclic, (name, found)
        if cyclic:
            assert len(found) == 1 and {"titanrl.rl.groups", "titanrl.rl.partial"} <= set(found[0]), (name, found)
    assert upward_imports(copy) == []  # a cycle inside a unit: the package check does not see it
