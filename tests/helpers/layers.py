"""The package's import graph between its units (subpackages and top-level modules), from every
import statement: module level, inside functions, under `TYPE_CHECKING`; and between its modules,
from the imports that run when a module is imported (`module_edges`)."""

import ast
import pathlib

LAYERS = [
    "config",
    "models",
    "distributed",
    "components",
    "data",
    "generator",
    "rewards",
    "envs",
    "algorithms",
    "plan",
    "rl",
    "trainer",
    "recipes",
    "train",
    "evaluate",
    "cli",
]
"""Bottom to top: a unit may import only units before it (CONTRIBUTING.md, "Layers")."""


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "titanrl" else None


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):  # importlib.import_module("titanrl.x") counts too
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def import_edges(package_dir: pathlib.Path) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> ['path:line', ...] for imports across units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent).with_suffix("").parts
        if len(rel) < 2:
            continue  # titanrl/__init__.py
        src = rel[1]
        package = ".".join(rel[:-1])
        for line, module in _imported_modules(ast.parse(path.read_text()), package):
            dst = _unit(module)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(package_dir.parent)}:{line}")
    return edges


def upward_imports(package_dir: pathlib.Path) -> list[str]:
    """Every import of a unit at or above the importer's layer, and every unit not in LAYERS."""
    problems = []
    for (src, dst), where in sorted(import_edges(package_dir).items()):
        for unit in (src, dst):
            if unit not in LAYERS:
                problems.append(f"unit '{unit}' is not in the layer order ({', '.join(where)})")
        if src in LAYERS and dst in LAYERS and LAYERS.index(dst) >= LAYERS.index(src):
            problems += [f"{w}: {src} imports {dst} (a layer above it)" for w in where]
    return problems


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, []).append(dst)
        graph.setdefault(dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _module_name(path: pathlib.Path, package_dir: pathlib.Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_at_import(tree: ast.AST) -> list[ast.AST]:
    """The nodes that run when the module is imported: all but function bodies (class bodies and
    `if TYPE_CHECKING:` blocks included)."""
    found, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found.append(node)
            todo.extend(ast.iter_child_nodes(node))
    return found


def _module_imports(tree: ast.AST, package: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module of the package) of each import that runs at import time; `from pkg import name`
    imports the submodule `pkg.name` when there is one, else `pkg`."""
    found = []
    for node in _run_at_import(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m in modules]


def module_edges(package_dir: pathlib.Path) -> dict[tuple[str, str], list[str]]:
    """(importing module, imported module) -> ['path:line', ...] between the package's modules, over
    the imports that run when a module is imported (module level and under `TYPE_CHECKING`: a type
    a module names is part of its design even when Python does not import it; not inside functions)."""
    paths = sorted(package_dir.rglob("*.py"))
    modules = {_module_name(p, package_dir) for p in paths}
    edges: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        src = _module_name(path, package_dir)
        package = src if path.name == "__init__.py" else src.rpartition(".")[0]
        for line, dst in _module_imports(ast.parse(path.read_text()), package, modules):
            if dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(package_dir.parent)}:{line}")
    return edges
