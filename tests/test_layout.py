"""The codebase's shape, checked: modules a reader can hold, no import cycles, no patched internals.

* every module of ``offload/``, ``autotune/`` and ``bench/`` has at most :data:`MAX_LINES` lines;
* no import cycle between modules, counting imports inside functions and under ``TYPE_CHECKING``
  (a package's ``__init__`` counts as a module; the implicit import of a parent package does not);
* ``autotune`` imports neither ``offload`` nor ``bench``; ``offload`` never imports ``bench``;
* no test or bench module patches a private name of ``offload`` or ``autotune``: no
  ``monkeypatch.setattr``/``setattr``/attribute assignment whose target is a private module
  (a dotted path with a part starting with ``_``), a name that is not exported by the package's
  ``__init__``, or an attribute starting with ``_``. Tests reach the code through public injection
  points (a plan, masks, a topology, a loader, a clock) instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "autotune", "bench")
LIBRARIES = ("offload", "autotune")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module ``name`` refers to (itself, or the nearest enclosing module)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path) -> set[str]:
    """Project modules ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = _resolve(f"{source}.{alias.name}") if f"{source}.{alias.name}" in MODULES else _resolve(source)
                if target:
                    found.add(target)
    found.discard(module)
    return found


def _graph() -> dict[str, set[str]]:
    return {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_fits_in_one_readers_head() -> None:
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_import_cycle_between_modules() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (function-level and type-only imports count): {cycles}"


@pytest.mark.parametrize(("package", "forbidden"), [("autotune", ("offload", "bench")), ("offload", ("bench",))])
def test_dependency_direction(package: str, forbidden: tuple[str, ...]) -> None:
    graph = _graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == package
                 for t in targets if t.split(".")[0] in forbidden)
    assert not bad, f"{package} must not import {forbidden}: {bad}"


def _exported(package: str) -> set[str]:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}  # type: ignore[attr-defined]
    return set()


def _private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] not in LIBRARIES:
        return False
    if any(p.startswith("_") for p in parts[1:]):
        return True
    # offload.X / autotune.X: X must be exported (or a public submodule such as autotune.knobs)
    return len(parts) > 1 and parts[1] not in _exported(parts[0]) and f"{parts[0]}.{parts[1]}" not in MODULES


def _names(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted origin, for names bound by imports from the libraries."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(expr: ast.expr, names: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value, names)
        return f"{base}.{expr.attr}" if base else None
    return None


def _patches(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = _names(tree)
    found = []
    for node in ast.walk(tree):
        target: str | None = None
        if isinstance(node, ast.Call):
            fn = node.func
            is_setattr = (isinstance(fn, ast.Attribute) and fn.attr in ("setattr", "delattr")) or (
                isinstance(fn, ast.Name) and fn.id in ("setattr", "delattr"))
            is_patch = isinstance(fn, (ast.Attribute, ast.Name)) and getattr(fn, "attr", getattr(fn, "id", "")) in (
                "patch", "object")
            if (is_setattr or is_patch) and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    target = first.value  # monkeypatch.setattr("offload._x.y", ...)
                else:
                    base = _dotted(first, names)
                    attr = node.args[1] if len(node.args) > 1 else None
                    if base and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                        target = f"{base}.{attr.value}"
                    elif base:
                        target = base
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute):
                    base = _dotted(t.value, names)
                    if base:
                        target = f"{base}.{t.attr}"
        if target and target.split(".")[0] in LIBRARIES and _private_path(target):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {target}")
    return found


def test_no_test_or_bench_module_patches_a_private_name() -> None:
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    found = [hit for f in files if f.name != "test_layout.py" for hit in _patches(f)]
    assert not found, "private names patched (use a public injection point):\n" + "\n".join(found)


def test_the_checks_themselves_catch_what_they_claim(tmp_path: Path) -> None:
    """The checkers flag a cycle, a private patch and an object from a private module."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import offload._pipeline as pm\nfrom offload._slabs import HostSlabs\nfrom offload import CPUOffloadAdamW\n"
        "def t(monkeypatch):\n"
        "    monkeypatch.setattr(pm, 'fused_adamw_', None)\n"
        "    monkeypatch.setattr(HostSlabs, 'first_touch', None)\n"
        "    monkeypatch.setattr(CPUOffloadAdamW, '_make_slabs', None)\n"
        "    monkeypatch.setattr('offload._threads._exchange', None)\n"
        "    monkeypatch.setattr(CPUOffloadAdamW, 'step', None)\n"
        "    pm.x = 1\n"
    )
    hits = sorted(_patches(sample, tmp_path), key=lambda h: int(h.split(":")[1]))
    assert [h.split(": ", 1)[1] for h in hits] == [
        "offload._pipeline.fused_adamw_", "offload._slabs.HostSlabs.first_touch",
        "offload.CPUOffloadAdamW._make_slabs", "offload._threads._exchange", "offload._pipeline.x"]
