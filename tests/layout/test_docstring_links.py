"""Every file and name a docstring of core/ or cli/ points at exists: a path (``core/methods/score.py``,
``methods/served.py``), a dotted name (``decodelab.core.kv.protocol.KVPolicy``) or a Sphinx role
(``:func:`.probe_keys```, ``:meth:`~.client.ServedEngine.generate```). A link that went stale when a file moved or a function was renamed sends
the reader nowhere; resolved statically (the modules' syntax trees), nothing is imported."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"decodelab.core": ROOT / "core", "decodelab.cli": ROOT / "cli", "decodelab.presets": ROOT / "presets"}
# a path of this project: a top folder (or a folder of core/ or cli/ written without it), then a file
OURS = ("core", "cli", "tests", "benchmarks", "docs", "presets", "examples", "analysis", "engine", "kv", "methods",
        "sampling", "trace", "view", "commands", "http", "batch", "speculative")
PATH = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w-]+/)*[\w-]+\.(?:py|md|toml|json|js|css|sh))\b" % "|".join(OURS))
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc):`~?([^`]+)`")
DOTTED = re.compile(r"(?<![\w.])(decodelab\.(?:core|cli|presets)(?:\.\w+)+)")
# where a relative path may start: the project root, or a top folder it is written without
PATH_BASES = (ROOT, ROOT / "core", ROOT / "cli", ROOT / "tests")


def module_file(module: str) -> Path | None:
    for package, folder in FOLDERS.items():
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").split(".") if module != package else []
            base = folder.joinpath(*rest)
            for candidate in (base / "__init__.py", base.with_suffix(".py")):
                if candidate.exists():
                    return candidate
    return None


@cache
def names_in(path: Path) -> dict[str, set[str]]:
    """A module's top-level names -> for a class, the names defined in its body (and its bases' where they are in
    the same module); for any other name, an empty set."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            members |= {f"__base__{ast.unparse(b)}" for b in node.bases}
            out[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.Assign):
            out.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
        elif isinstance(node, ast.If):  # names defined under `if TYPE_CHECKING:` and the like
            for sub in node.body:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    out.update({(a.asname or a.name).split(".")[0]: set() for a in sub.names})
    return out


def member_of(path: Path, cls: str, name: str, seen: frozenset = frozenset()) -> bool:
    members = names_in(path).get(cls, set())
    if name in members:
        return True
    bases = [m[len("__base__"):] for m in members if m.startswith("__base__")]
    return any(member_of(path, b, name, seen | {cls}) for b in bases if b in names_in(path) and b not in seen)


def resolves(dotted: str) -> bool:
    """``decodelab.core.x.y.Name.member`` names a module, a top-level name in one, or a member of a class in one
    (a name a module imports counts as defined there: its own module is checked where it is linked)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        names = names_in(path)
        if rest[0] not in names:
            return False
        return len(rest) == 1 or (len(rest) == 2 and member_of(path, rest[0], rest[1]))
    return False


def module_name(path: Path) -> tuple[str, bool]:
    for package, folder in FOLDERS.items():
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            return ".".join([package] + (parts[:-1] if is_pkg else parts)), is_pkg
    raise ValueError(path)


def role_target(text: str, module: str, is_pkg: bool) -> list[str]:
    """The absolute names a role's target may mean: a leading dot is relative to the module's package (Sphinx
    searches the current module, then upward); a bare name is the current module's (or its package's)."""
    target = text.strip().rstrip("()")
    package = module if is_pkg else module.rsplit(".", 1)[0]
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        base = package.split(".")[: len(package.split(".")) - (dots - 1)]
        rest = target.lstrip(".")
        out = [".".join(base + [rest])]
        scope = module.split(".")
        while len(scope) > 2:  # Sphinx's search from the current module outward
            out.append(".".join(scope + [rest]))
            scope = scope[:-1]
        return out
    if target.startswith("decodelab."):
        return [target]
    return [f"{module}.{target}", f"{package}.{target}"]


def docstrings(path: Path):
    """(line, docstring, the class it is written in or None) for the module, every class and every function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def visit(node, cls):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            inner = node.name if isinstance(node, ast.ClassDef) else cls
            if text:
                yield (node.body[0].lineno if node.body else 1), text, inner
            for child in ast.iter_child_nodes(node):
                yield from visit(child, inner)

    yield from visit(tree, None)


def stale_links(files) -> list[str]:
    """``files``: (path, its module's name, whether it is a package's __init__)."""
    out = []
    for path, module, is_pkg in files:
        where = path.relative_to(ROOT) if ROOT in path.parents else path
        for line, text, cls in docstrings(path):
            for m in PATH.finditer(text):
                rel = m.group(1)
                if not any((base / rel).exists() for base in PATH_BASES + (path.parent,)):
                    out.append(f"{where}:{line} path {rel}")
            for m in ROLE.finditer(text):
                target = m.group(1).strip().rstrip("()")
                in_class = cls is not None and "." not in target and member_of(path, cls, target)
                if not in_class and not any(resolves(t) for t in role_target(target, module, is_pkg)):
                    out.append(f"{where}:{line} {m.group(0)}")
            for m in DOTTED.finditer(ROLE.sub("", text)):
                if not resolves(m.group(1).rstrip(".")):
                    out.append(f"{where}:{line} name {m.group(1)}")
    return out


def project_files() -> list[tuple[Path, str, bool]]:
    return [(p, *module_name(p)) for folder in (ROOT / "core", ROOT / "cli") for p in sorted(folder.rglob("*.py"))]


def test_every_link_in_a_docstring_resolves():
    stale = stale_links(project_files())
    assert not stale, "\n".join(stale)


def test_a_stale_link_is_found(tmp_path):
    """A negative control: a docstring pointing at a file, a module, a function and a method that do not exist is
    reported four times; the same links made right are not."""
    text = ('"""See core/kv/nowhere.py, :func:`decodelab.core.kv.protocol.no_such`, :mod:`.gone` and\n'
            ':meth:`~decodelab.core.kv.protocol.KVPolicy.nothing`."""\n')
    fine = ('"""See core/kv/protocol.py, :func:`decodelab.core.kv.protocol.register`, :mod:`.full`,\n'
            ':meth:`~decodelab.core.kv.protocol.KVPolicy.truncate`, decodelab.core.kv.protocol.CacheSpec.options."""\n')
    names = []
    for i, body in enumerate((text, fine)):
        fake = tmp_path / f"probe{i}.py"
        fake.write_text(body, encoding="utf-8")
        names.append(stale_links([(fake, "decodelab.core.kv.probe", False)]))
    assert len(names[0]) == 4, names[0]
    assert names[1] == [], names[1]
