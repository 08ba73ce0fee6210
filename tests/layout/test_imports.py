"""The shape of the code: core/ imports flow one way, down the layers of docs' architecture
(``analysis -> methods -> trace -> sampling -> engine -> kv -> settings, inputs -> errors``, cli above all of core),
with no import cycle anywhere in the project (function-local imports counted), none hidden behind a function-local
import in core, and never reach the CLI libraries."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
PACKAGE = "decodelab.core"


def module_of(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join([PACKAGE] + parts), is_pkg


def absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def core_imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported decodelab.core module, line, at top level)], a `from pkg import sub` counted as sub."""
    modules = {module_of(p)[0] for p in CORE.rglob("*.py")}
    graph: dict[str, list[tuple[str, int, bool]]] = {}
    for path in CORE.rglob("*.py"):
        module, is_pkg = module_of(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node) for node in tree.body}
        edges = []
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = absolute(module, is_pkg, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.startswith(PACKAGE) and target != module:
                    edges.append((target, node.lineno, id(node) in top))
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A cycle of the directed graph as a list of modules (first = last), or None; iterative DFS."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def package_of(module: str) -> str:
    """A module's unit for the cycle check: the package below decodelab.core of a package module, or itself."""
    return module


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None
    assert find_cycle({"a": ["a"]}) == ["a", "a"]


def test_core_has_no_import_cycle():
    graph = {m: [t for t, _, _ in edges] for m, edges in core_imports().items()}
    # a package's __init__ importing its own modules is how a registry fills itself, not a cycle of ideas
    graph = {m: [t for t in ts if not (t.startswith(m + ".") and (CORE / m[len(PACKAGE) + 1:].replace(".", "/")
                                                                  / "__init__.py").exists())]
             for m, ts in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_core_hides_no_import_inside_a_function():
    local = [f"{m}:{line} imports {t}" for m, edges in core_imports().items() for t, line, top in edges if not top]
    assert not local, local


def test_core_never_imports_the_cli_libraries():
    offenders = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                          if n.split(".")[0] in ("typer", "rich", "tabulate", "click")]
    assert not offenders, offenders


def test_the_public_api_resolves_and_stays_light():
    """Every name of decodelab.core's API is what its module defines, and importing the package imports no torch
    (the CLI's --help relies on light core modules)."""
    import subprocess
    import sys

    import decodelab.core as core

    for name in core.__all__:
        assert getattr(core, name) is getattr(__import__(f"decodelab.core.{core._API[name]}",
                                                         fromlist=[name]), name), name
    light = subprocess.run([sys.executable, "-c", "import sys, decodelab.core, decodelab.core.errors, "
                            "decodelab.core.sampling.registry; print('torch' in sys.modules)"],
                           capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "False"


# --- the layers and the whole project --------------------------------------------------------------------------

CLI = ROOT / "cli"
CLI_PACKAGE = "decodelab.cli"
# core's layers, top first: a module may import its own layer or one below, never one above
LAYERS = (("analysis",), ("methods",), ("trace",), ("sampling",), ("engine",), ("kv",), ("settings", "inputs"),
          ("errors",))


def project_imports() -> dict[str, list[tuple[str, int]]]:
    """Every module of core/ and cli/ -> [(imported decodelab module, line)], function-local imports included, a
    `from pkg import sub` counted as sub (a name imported from a package's __init__ counts as the package)."""
    roots = ((CORE, PACKAGE), (CLI, CLI_PACKAGE))
    files = {}
    for folder, package in roots:
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            files[".".join([package] + (parts[:-1] if is_pkg else parts))] = (path, is_pkg)
    graph: dict[str, list[tuple[str, int]]] = {}
    for module, (path, is_pkg) in files.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = absolute(module, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges += [(t, node.lineno) for t in targets if t.startswith("decodelab.") and t != module]
        graph[module] = edges
    return graph


def without_registry_fills(graph: dict[str, list[str]]) -> dict[str, list[str]]:
    """A package's __init__ importing its own modules (how a registry fills itself) is not a cycle of ideas."""
    return {m: [t for t in ts if not t.startswith(m + ".")] for m, ts in graph.items()}


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a core module's folder (or top-level module); None for core's __init__ (the API)."""
    if not module.startswith(PACKAGE + "."):
        return None
    head = module[len(PACKAGE) + 1:].split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if head in names)


def upward(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Imports that go up: a core module importing a layer above its own, or core importing the CLI."""
    out = []
    for module, edges in graph.items():
        if not module.startswith(PACKAGE + "."):
            continue
        for target, line in edges:
            below = layer_of(target)
            if target.startswith(CLI_PACKAGE) or target == PACKAGE or (below is not None and below < layer_of(module)):
                out.append(f"{module}:{line} imports {target}")
    return out


def test_every_core_module_has_a_layer():
    """A new folder of core must be placed in LAYERS (and in docs/ARCHITECTURE's order) before it can be imported."""
    heads = {p.relative_to(CORE).parts[0].removesuffix(".py") for p in CORE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert heads == {n for names in LAYERS for n in names}


def test_imports_never_go_up_a_layer():
    assert not upward(project_imports()), upward(project_imports())


def test_the_layer_check_finds_an_arrow_up():
    """A negative control: the check above finds what it looks for."""
    graph = {f"{PACKAGE}.methods.stream": [(f"{PACKAGE}.analysis.probe", 3), (f"{PACKAGE}.kv", 4)],
             f"{PACKAGE}.kv.full": [(f"{PACKAGE}.errors", 1), (f"{CLI_PACKAGE}.options", 2)],
             f"{PACKAGE}.settings": [(f"{PACKAGE}.inputs", 5)], f"{PACKAGE}.inputs": [(f"{PACKAGE}.settings", 6)],
             f"{CLI_PACKAGE}.main": [(f"{PACKAGE}.analysis.probe", 1)]}
    assert upward(graph) == [f"{PACKAGE}.methods.stream:3 imports {PACKAGE}.analysis.probe",
                             f"{PACKAGE}.kv.full:2 imports {CLI_PACKAGE}.options"]


def test_the_project_has_no_import_cycle():
    """core/ and cli/ together, function-local imports counted (a cycle through one is still a cycle)."""
    graph = without_registry_fills({m: [t for t, _ in edges] for m, edges in project_imports().items()})
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
