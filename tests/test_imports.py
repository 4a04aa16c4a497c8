"""Import hygiene of the package: every module imports on its own (no import cycles that only
work from some entry points), and no module uses another subpackage's private names."""

import ast
import json
import sys
import textwrap
import warnings
from pathlib import Path

from helpers import background

import titanrl

PACKAGE_DIR = Path(titanrl.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files() -> list[Path]:
    """Every .py file of the package, found on disk (walking with pkgutil would import them)."""
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


# One interpreter for all modules: torch (and every other third-party module) stays imported
# between iterations, only `titanrl` and `titanrl.*` are dropped before each import.
_IMPORT_EACH = textwrap.dedent(
    """
    import importlib, json, sys, traceback
    import torch  # noqa: F401  (kept loaded: the expensive part of every import)

    results = {}
    for name in json.loads(sys.argv[1]):
        for key in [k for k in sys.modules if k == "titanrl" or k.startswith("titanrl.")]:
            del sys.modules[key]
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing and missing != "titanrl" and not missing.startswith("titanrl."):
                results[name] = ["skipped", f"needs the missing module '{missing}'"]
            else:
                results[name] = ["failed", traceback.format_exc(limit=-4)]
        except BaseException as e:  # noqa: BLE001 - SystemExit etc. at import time is a failure too
            results[name] = ["failed", traceback.format_exc(limit=-4)]
        else:
            results[name] = ["ok", ""]
    print("RESULTS " + json.dumps(results))
    """
)


# One subprocess for all modules, run in the background from collection on (helpers/background.py).
background.register(
    "imports",
    ("tests/test_imports.py::test_every_module_imports_on_its_own",),
    lambda folder: [sys.executable, "-c", _IMPORT_EACH, json.dumps([module_name(p) for p in package_files()])],
)


def test_every_module_imports_on_its_own():
    names = [module_name(p) for p in package_files()]
    proc, _ = background.result("imports", timeout_s=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"the import checker itself failed:\n{proc.stdout}\n{proc.stderr}"
    results = json.loads(lines[-1][len("RESULTS ") :])
    assert sorted(results) == sorted(names)
    skipped = {n: why for n, (status, why) in results.items() if status == "skipped"}
    failed = {n: why for n, (status, why) in results.items() if status == "failed"}
    if skipped:
        warnings.warn(
            "modules not import-checked (optional extra not installed): "
            + "; ".join(f"{n} ({why})" for n, why in sorted(skipped.items())),
            stacklevel=1,
        )
    assert not failed, f"{len(failed)} module(s) do not import on their own:\n\n" + "\n".join(
        f"== {n}\n{why}" for n, why in sorted(failed.items())
    )


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(dotted: str) -> bool:
    path = REPO_ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _subpackage(dotted: str) -> str | None:
    """'titanrl.rewards.runner' -> 'rewards'; 'titanrl' -> None (a top-level module such as
    'titanrl.train' is its own unit: 'train')."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == "titanrl" and len(parts) > 1 else None


def private_cross_imports(path: Path) -> list[str]:
    """`from titanrl.<pkg>... import _name`, private modules (`titanrl.<pkg>._mod`) and
    `titanrl.<pkg>.<mod>._name` attribute use, where <pkg> is not the file's own subpackage."""
    own_module = module_name(path)
    own_pkg = _subpackage(own_module)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> dotted titanrl module it is bound to
    where = path.relative_to(REPO_ROOT)

    def check_dotted(dotted: str, lineno: int, what: str) -> None:
        """Private components of a titanrl dotted name, if its subpackage is not ours."""
        if not (dotted == "titanrl" or dotted.startswith("titanrl.")) or _subpackage(dotted) == own_pkg:
            return
        if any(_is_private(part) for part in dotted.split(".")):
            found.append(f"{where}:{lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = own_module.split(".") if is_package else own_module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                dotted = f"{base}.{alias.name}" if alias.name != "*" else base
                check_dotted(dotted, node.lineno, f"from {base} import {alias.name}")
                if alias.name != "*" and _is_module(dotted):
                    aliases[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                check_dotted(alias.name, node.lineno, f"import {alias.name}")
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])

    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        chain.reverse()
        # The longest module prefix of `alias.a.b...`, then the attribute right after it.
        dotted = aliases[inner.id]
        if not _is_module(dotted):
            continue
        for part in chain:
            if _is_module(f"{dotted}.{part}"):
                dotted = f"{dotted}.{part}"
                continue
            if _is_private(part):
                check_dotted(f"{dotted}.{part}", node.lineno, f"{dotted}.{part}")
            break
    return sorted(set(found))


def test_no_private_cross_package_imports():
    found = [line for path in package_files() for line in private_cross_imports(path)]
    assert not found, "private names used across subpackages (make them public, in a shared module):\n" + "\n".join(
        found
    )


def test_private_import_checker_catches_what_it_should(tmp_path, monkeypatch):
    """The AST scan itself: a cross-package private import, a private attribute through a
    module alias and a relative one are found; a same-package private import is allowed."""
    pkg = tmp_path / "titanrl"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / "mod.py").write_text("_x = 1\ny = 2\n")
    (pkg / "__init__.py").write_text("")
    user = pkg / "a" / "user.py"
    user.write_text(
        textwrap.dedent(
            """
        from titanrl.a.mod import _x as ok_same_package
        from titanrl.b.mod import _x
        from titanrl.b.mod import y, __doc__
        from ..b.mod import _x as rel
        import titanrl.b.mod
        import titanrl.b.mod as bm
        from titanrl.b import mod
        titanrl.b.mod._x, bm._x, mod._x, bm.y, titanrl.a.mod._x
        """
        )
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    found = private_cross_imports(user)
    lines = sorted(int(f.split(":")[1]) for f in found)
    assert lines == [3, 5, 9], found
