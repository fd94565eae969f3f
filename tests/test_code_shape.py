"""The code's shape, checked: modules a reader can hold, no import cycles, no patched internals.

* every module of ``offload/``, ``autotune/`` and ``bench/`` has at most :data:`MAX_LINES` lines;
* no import cycle between modules, counting imports inside functions and under ``TYPE_CHECKING``
  (a package's ``__init__`` counts as a module; the implicit import of a parent package does not);
* ``autotune`` imports neither ``offload`` nor ``bench``; ``offload`` never imports ``bench``;
* ``offload``'s top-level import graph (a subpackage is one node) has at most :data:`MAX_NODES`
  nodes, :data:`MAX_LAYERS` layers and :data:`MAX_EDGES` edges, and each part imports only the
  parts under it (:data:`PARTS`); ``autotune``'s has at most :data:`AUTOTUNE_MAX_NODES` nodes and
  each of its nodes imports only the nodes under it (:data:`AUTOTUNE_PARTS`); ``bench``'s has at
  most :data:`BENCH_MAX_NODES` nodes and :data:`BENCH_MAX_EDGES` edges, and its shared modules
  (:data:`BENCH_SHARED`) import no benchmark;
* no test or bench module patches a private name of ``offload`` or ``autotune``. A patch is a
  ``setattr``/``delattr`` (builtin, ``monkeypatch.``, ``object.__setattr__``), ``mock.patch``
  (a dotted string, also as ``target=``), ``patch.object``, ``patch.multiple``, ``patch.dict``,
  ``monkeypatch.setitem``/``delitem``, or an assignment, augmented assignment or ``del`` of an
  attribute or item; its target is private when it is in a private module (a dotted path with a
  part starting with ``_``), is a name the package's ``__init__`` does not export, or is an
  attribute starting with ``_``. A module is followed through imports, aliases
  (``m = offload._x``), ``importlib.import_module("offload._x")``, ``sys.modules[...]``,
  ``getattr(m, "x")``, ``vars(m)`` and ``m.__dict__`` (whose entries are the module's names);
  replacing a private module in ``sys.modules`` is a patch too. A private attribute (``_name``, not a dunder) set or
  deleted on any object counts, whatever the object, unless the object is ``self``/``cls`` or the
  file's own (a class or function it defines, or a name bound to an instance of such a class).
  Tests reach the code through public injection points (a plan, masks, a topology, a loader, a
  clock) instead.
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


def test_offload_uses_only_the_public_autotune() -> None:
    """``offload`` is a client of ``autotune``: it imports the package and its public ``knobs``
    module, never a private module (what it needs is exported)."""
    graph = _graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == "offload"
                 for t in targets if t.split(".")[0] == "autotune" and _private_path(t))
    assert not bad, f"offload imports private autotune modules: {bad}"


#: ``offload``'s parts (its subpackages) and the leaf records every part may use, with what each
#: may import of the rest of ``offload`` (docs/architecture.md draws the same picture).
LEAVES = {"_settings": set(), "_stats": {"_settings"}}
PARTS: dict[str, set[str]] = {
    "kernels": set(),
    "threads": set(),
    "state": {"kernels", "threads"},
    "pipeline": {"state", "kernels", "threads"},
    "overlap": {"state", "pipeline", "kernels"},
    "tuning": {"state", "threads", "kernels"},
}
#: Limits on the top-level import graph of ``offload`` (a subpackage is one node).
MAX_NODES, MAX_LAYERS, MAX_EDGES = 14, 8, 50


def _node(module: str) -> str:
    """``offload.state._slabs`` -> ``state``; ``offload._optimizer`` -> ``_optimizer``; the package's
    own ``__init__`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _top_graph(package: str = "offload") -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        if m.split(".")[0] != package:
            continue
        src = _node(m)
        out.setdefault(src, set()).update(_node(t) for t in targets if t.split(".")[0] == package)
        out[src].discard(src)
    return out


def _layers(graph: dict[str, set[str]]) -> int:
    """The longest import chain, counted in nodes (the graph has no cycle)."""
    depth: dict[str, int] = {}

    def d(v: str) -> int:
        if v not in depth:
            depth[v] = 0
            depth[v] = 1 + max((d(w) for w in graph.get(v, ())), default=0)
        return depth[v]

    return max(d(v) for v in graph)


def test_offload_top_level_graph_is_small_and_layered() -> None:
    graph = _top_graph()
    assert not _cycles(graph), f"import cycles between offload's parts: {_cycles(graph)}"
    edges = sum(len(t) for t in graph.values())
    assert len(graph) <= MAX_NODES, f"{len(graph)} top-level nodes in offload (at most {MAX_NODES}): {sorted(graph)}"
    assert _layers(graph) <= MAX_LAYERS, f"{_layers(graph)} layers (at most {MAX_LAYERS})"
    assert edges <= MAX_EDGES, f"{edges} import edges between offload's top-level nodes (at most {MAX_EDGES})"


#: Limits on ``bench``'s top-level import graph (issue 39: grouped by what it measures, a
#: subpackage per concern; it was 54 nodes and 130 edges as flat modules).
BENCH_MAX_NODES, BENCH_MAX_EDGES = 25, 60
#: ``bench``'s shared modules: they import nothing else of ``bench``.
BENCH_SHARED = ("_args", "_stats", "_cli")


def test_bench_top_level_graph_is_small() -> None:
    graph = _top_graph("bench")
    edges = sum(len(t) for t in graph.values())
    assert len(graph) <= BENCH_MAX_NODES, f"{len(graph)} top-level nodes in bench (at most {BENCH_MAX_NODES}): {sorted(graph)}"
    assert edges <= BENCH_MAX_EDGES, f"{edges} import edges between bench's top-level nodes (at most {BENCH_MAX_EDGES})"
    bad = {m: sorted(graph[m] - set(BENCH_SHARED)) for m in BENCH_SHARED if graph[m] - set(BENCH_SHARED)}
    assert not bad, f"bench's shared modules import benchmarks: {bad}"


def test_offload_parts_import_only_what_they_stand_on() -> None:
    """kernels and threads import nothing else of offload but the leaf records (``_settings``: the
    environment); state stands on them; the pipeline on state (never on overlap); no part imports
    the root's modules but the leaf records."""
    graph = _top_graph()
    assert set(PARTS) <= set(graph), f"missing parts: {set(PARTS) - set(graph)}"
    bad = {part: sorted(graph[part] - allowed - set(LEAVES)) for part, allowed in PARTS.items()
           if graph[part] - allowed - set(LEAVES)}
    bad.update({leaf: sorted(graph.get(leaf, set()) - allowed) for leaf, allowed in LEAVES.items()
                if graph.get(leaf, set()) - allowed})
    assert not bad, f"imports a part must not make (part -> forbidden targets): {bad}"


#: ``autotune``'s top-level nodes (its parts, the root's modules and the package's ``__init__``)
#: with everything each may import of the rest of ``autotune`` (docs/architecture.md draws the
#: same picture): every import runs down, none from a lower layer up.
AUTOTUNE_PARTS: dict[str, set[str]] = {
    "knobs": set(),
    "measure": set(),
    "_config": {"measure"},
    "agree": {"knobs"},
    "cache": {"measure", "knobs"},
    "report": {"cache", "knobs"},
    "decide": {"measure", "_config"},
    "tuner": {"decide", "agree", "cache", "report", "measure", "_config", "knobs"},
    "testing": {"agree"},
    "__main__": {"report"},
    "__init__": {"tuner", "agree", "cache", "report", "measure", "_config"},
}
#: Limit on ``autotune``'s top-level nodes (modules and packages at its root, ``__init__`` included).
AUTOTUNE_MAX_NODES = 12


def test_autotune_top_level_is_small_and_every_import_runs_down() -> None:
    graph = _top_graph("autotune")
    assert not _cycles(graph), f"import cycles between autotune's parts: {_cycles(graph)}"
    assert len(graph) <= AUTOTUNE_MAX_NODES, \
        f"{len(graph)} top-level nodes in autotune (at most {AUTOTUNE_MAX_NODES}): {sorted(graph)}"
    unplaced = set(graph) - set(AUTOTUNE_PARTS)
    assert not unplaced, f"autotune nodes without a place in AUTOTUNE_PARTS: {sorted(unplaced)}"
    bad = {node: sorted(graph[node] - AUTOTUNE_PARTS[node]) for node in graph if graph[node] - AUTOTUNE_PARTS[node]}
    assert not bad, f"imports an autotune node must not make (node -> forbidden targets): {bad}"


def test_the_part_rules_catch_what_they_claim() -> None:
    """The graph helpers see a cycle and count layers as chains of nodes."""
    assert _layers({"a": {"b"}, "b": {"c"}, "c": set()}) == 3
    assert _node("offload.state._slabs") == "state" and _node("offload._optimizer") == "_optimizer"
    assert _node("offload") == "__init__"


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


def _import_module_name(expr: ast.expr) -> str | None:
    """The module ``importlib.import_module("x")`` / ``import_module("x")`` returns, or the one
    ``__import__("x")`` returns (the top package unless a ``fromlist`` is given)."""
    if not (isinstance(expr, ast.Call) and expr.args and isinstance(expr.args[0], ast.Constant)
            and isinstance(expr.args[0].value, str)):
        return None
    fn, name = expr.func, expr.args[0].value
    called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    if called == "import_module":
        return name
    if called == "__import__":
        return name if len(expr.args) > 3 or any(k.arg == "fromlist" for k in expr.keywords) else name.split(".")[0]
    return None


def _names(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted origin, for names bound to something of the libraries: by an import, by
    ``importlib.import_module(...)``, or by assigning such a name or expression to another name."""
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
    aliases = [(t.id, node.value) for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    for _ in range(4):  # an alias of an alias of ...
        for name, value in aliases:
            origin = _dotted(value, out)
            if origin and origin.split(".")[0] in LIBRARIES:
                out[name] = origin
    return out


def _dotted(expr: ast.expr, names: dict[str, str]) -> str | None:
    """The dotted path ``expr`` stands for, where it can be read off the file (None otherwise):
    names, attributes, ``import_module("m")``, ``getattr(x, "a")``, ``sys.modules["m"]``, and
    ``vars(x)`` as ``x.__dict__``."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value, names)
        return f"{base}.{expr.attr}" if base else None
    if isinstance(expr, ast.Call) and (module := _import_module_name(expr)):
        return module
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.args:
        base = _dotted(expr.args[0], names)
        if base and expr.func.id == "vars" and len(expr.args) == 1:
            return f"{base}.__dict__"
        if base and expr.func.id == "getattr" and len(expr.args) >= 2 and _text(expr.args[1]):
            return f"{base}.{_text(expr.args[1])}"
        return None
    if isinstance(expr, ast.Subscript) and _is_sys_modules(expr.value):
        return _text(expr.slice)
    return None


def _text(expr: ast.expr | None) -> str | None:
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None


def _is_sys_modules(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == "modules" and isinstance(expr.value, ast.Name) \
        and expr.value.id == "sys"


def _root(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _local_names(tree: ast.Module) -> set[str]:
    """Names the file defines itself: ``self``/``cls``, its classes and functions, and names bound
    to an instance of one of its classes (a private attribute of these is the file's own business)."""
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    instances = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                 and isinstance(n.value.func, ast.Name) and n.value.func.id in classes
                 for t in n.targets if isinstance(t, ast.Name)}
    return {"self", "cls"} | defined | instances


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _Patches:
    """Every patch of a file whose target is a private name of the libraries (see the module doc)."""

    def __init__(self, tree: ast.Module) -> None:
        self.names = _names(tree)
        self.local = _local_names(tree)
        self.found: list[tuple[int, str]] = []

    def hit(self, node: ast.AST, target: str) -> None:
        self.found.append((node.lineno, target))  # type: ignore[attr-defined]

    def path(self, node: ast.AST, dotted: str | None) -> None:
        """A dotted target (``"offload._x.y"``, or one read off an expression)."""
        if dotted and dotted.split(".")[0] in LIBRARIES and _private_path(dotted):
            self.hit(node, dotted)

    def attr(self, node: ast.AST, obj: ast.expr | None, name: str | None) -> None:
        """``obj.name`` set or deleted (``name`` None: an attribute not spelled in the file)."""
        if obj is None:
            return
        if isinstance(obj, ast.Constant) and isinstance(obj.value, str):
            self.path(node, f"{obj.value}.{name}" if name else obj.value)
            return
        base = _dotted(obj, self.names)
        if base and base.split(".")[0] in LIBRARIES:
            self.path(node, f"{base}.{name}" if name else base)
        elif name and name.startswith("_") and not _dunder(name) and _root(obj) not in self.local:
            self.hit(node, f"{ast.unparse(obj)}.{name}")  # a private attribute of something not of this file

    def item(self, node: ast.AST, mapping: ast.expr | None, keys: list[ast.expr | None]) -> None:
        """``mapping[key]`` set or deleted for each of ``keys`` (None: a key not spelled in the file)."""
        if mapping is None:
            return
        if _is_sys_modules(mapping):
            for key in keys:
                self.path(node, _text(key))  # sys.modules["offload._x"] = fake
            return
        dotted = _text(mapping) or _dotted(mapping, self.names)
        if dotted and dotted.endswith(".__dict__") and dotted.split(".")[0] in LIBRARIES:
            module = dotted.removesuffix(".__dict__")
            for key in keys:
                if _text(key) is None:
                    self.hit(node, dotted)  # some entry of a library's namespace
                else:
                    self.path(node, f"{module}.{_text(key)}")
        else:
            self.path(node, dotted)  # offload._x.TABLE[k] = v

    def call(self, node: ast.Call) -> None:
        fn = node.func
        called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        args: list[ast.expr | None] = [*node.args, None, None, None]
        on_patch = isinstance(fn, ast.Attribute) and (
            (isinstance(fn.value, ast.Attribute) and fn.value.attr == "patch")
            or (isinstance(fn.value, ast.Name) and fn.value.id == "patch"))
        if called in ("setattr", "delattr", "__setattr__", "__delattr__"):
            obj, name = args[0] or kw.get("target"), args[1] or kw.get("name")
            if _text(obj) is not None and _text(name) is None:
                self.path(node, _text(obj))  # monkeypatch.setattr("offload._x.y", value)
            else:
                self.attr(node, obj, _text(name))
        elif called == "patch" and not on_patch:
            self.path(node, _text(args[0] or kw.get("target")))  # (mock.)patch("offload._x.y")
        elif called == "object" and on_patch:
            self.attr(node, args[0] or kw.get("target"), _text(args[1] or kw.get("attribute")))
        elif called == "multiple" and on_patch:
            target = args[0] or kw.get("target")
            options = {"target", "spec", "create", "spec_set", "autospec", "new_callable"}
            for name in [k for k in kw if k not in options] or [None]:
                self.attr(node, target, name)
        elif called == "dict" and on_patch:
            values = args[1] or kw.get("values")
            keys = [k for k in values.keys] if isinstance(values, ast.Dict) else [] if values is None else [None]
            extra = [ast.Constant(k) for k in kw if k not in ("in_dict", "values", "clear")]
            self.item(node, args[0] or kw.get("in_dict"), keys + extra or [None])
        elif called in ("setitem", "delitem"):  # monkeypatch.setitem(mapping, key, value)
            self.item(node, args[0] or kw.get("dic"), [args[1] or kw.get("name")])
        elif called in ("__setitem__", "__delitem__", "update", "pop", "popitem", "setdefault", "clear") \
                and isinstance(fn, ast.Attribute):
            dotted = _dotted(fn.value, self.names)
            if (dotted and dotted.endswith(".__dict__")) or _is_sys_modules(fn.value):
                first = args[0]
                if called == "update":  # update({...}), update(other), update(k=v)
                    keys = list(first.keys) if isinstance(first, ast.Dict) else [] if first is None else [None]
                    keys += [ast.Constant(k) for k in kw]
                else:
                    keys = [None] if called in ("popitem", "clear") else [first]
                self.item(node, fn.value, keys)

    def store(self, node: ast.AST, target: ast.expr) -> None:
        """An assignment or ``del`` of ``target``."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self.store(node, elt)
        elif isinstance(target, ast.Starred):
            self.store(node, target.value)
        elif isinstance(target, ast.Attribute):
            self.attr(node, target.value, target.attr)
        elif isinstance(target, ast.Subscript):
            self.item(node, target.value, [target.slice])


def _patches(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    scan = _Patches(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            scan.call(node)
        elif isinstance(node, (ast.Assign, ast.Delete)):
            for t in node.targets:
                scan.store(node, t)
        elif isinstance(node, ast.AugAssign) or (isinstance(node, ast.AnnAssign) and node.value is not None):
            scan.store(node, node.target)
    return [f"{path.relative_to(root)}:{line}: {target}" for line, target in scan.found]


def test_no_test_or_bench_module_patches_a_private_name() -> None:
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    found = [hit for f in files if f.name != Path(__file__).name for hit in _patches(f)]
    assert not found, "private names patched (use a public injection point):\n" + "\n".join(found)


def test_the_checks_themselves_catch_what_they_claim(tmp_path: Path) -> None:
    """The checkers flag a cycle, and every form of patch the module doc names (one per line, the
    comment names the form); the lines after the last flagged one must not be flagged."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import importlib, sys\n"
        "from unittest import mock\n"
        "from unittest.mock import patch\n"
        "import offload, offload.pipeline._pipeline as pm\n"
        "from offload.state._slabs import HostSlabs\n"
        "from offload import CPUOffloadAdamW\n"
        "threads = importlib.import_module('offload.threads._plan')\n"
        "alias = pm\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._state = 0\n"
        "mine = Mine()\n"
        "def t(monkeypatch, opt, thing):\n"
        "    monkeypatch.setattr(pm, 'fused_adamw_', None)\n"  # a private module's name
        "    monkeypatch.setattr(HostSlabs, 'first_touch', None)\n"  # an object of a private module
        "    monkeypatch.setattr(CPUOffloadAdamW, '_make_slabs', None)\n"  # a private attribute
        "    monkeypatch.setattr('offload.threads._plan._exchange', None)\n"  # a dotted string
        "    pm.x = 1\n"  # an assignment
        "    monkeypatch.setattr(opt, '_pipeline', None)\n"  # a private attribute of an instance
        "    setattr(opt, '_slabs', None)\n"  # ... by the builtin
        "    object.__setattr__(opt, '_items', None)\n"  # ... past a __setattr__
        "    opt._pipeline = None\n"  # ... assigned
        "    thing.sub._count += 1\n"  # ... augmented
        "    del opt._slabs\n"  # ... deleted
        "    del pm.fused_adamw_\n"  # a private module's name deleted
        "    monkeypatch.delattr(pm, 'fused_adamw_')\n"  # ... by monkeypatch
        "    monkeypatch.setitem(pm.__dict__, 'new_item', None)\n"  # a module's namespace
        "    monkeypatch.setitem(vars(offload.threads._plan), 'thread_limit', None)\n"  # ... through vars()
        "    pm.__dict__['Pipeline'] = None\n"  # ... assigned
        "    pm.__dict__.update(Launch=None)\n"  # ... updated
        "    monkeypatch.setitem(sys.modules, 'offload.threads._numa', None)\n"  # a private module replaced
        "    mock.patch.dict(pm.__dict__, {'Worker': None})\n"  # patch.dict on a namespace
        "    mock.patch.dict('offload.state._items.KINDS', {'a': 1})\n"  # patch.dict on a private table
        "    patch.multiple(pm, fused_adamw_=None)\n"  # patch.multiple
        "    patch.multiple('offload.state._slabs', plan_chunks=None)\n"  # ... on a dotted string
        "    mock.patch('offload.kernels._adamw.fused_adamw_')\n"  # mock.patch
        "    patch(target='offload.threads._plan._exchange')\n"  # a keyword target
        "    mock.patch.object(target=alias, attribute='Queue', new=1)\n"  # an alias, keywords
        "    monkeypatch.setattr(threads, 'thread_limit', None)\n"  # a module from import_module
        "    monkeypatch.setattr(importlib.import_module('offload.threads._numa'), 'bind', None)\n"  # ... inline
        "    monkeypatch.setattr(sys.modules['offload.state._slabs'], 'HostSlabs', None)\n"  # from sys.modules
        "    monkeypatch.setattr(getattr(offload, '_stock'), 'thread_plan', None)\n"  # through getattr
        "    monkeypatch.setattr(CPUOffloadAdamW, 'step', None)\n"  # not flagged: public
        "    monkeypatch.setattr(offload, 'CPUOffloadAdamW', None)\n"
        "    monkeypatch.setattr(opt, 'step', None)\n"
        "    monkeypatch.setitem(sys.modules, 'matplotlib', None)\n"
        "    mine._state = 1\n"  # this file's own object
        "    Mine._state = 2\n"
    )
    hits = sorted(_patches(sample, tmp_path), key=lambda h: int(h.split(":")[1]))
    assert [h.split(": ", 1)[1] for h in hits] == [
        "offload.pipeline._pipeline.fused_adamw_", "offload.state._slabs.HostSlabs.first_touch",
        "offload.CPUOffloadAdamW._make_slabs", "offload.threads._plan._exchange", "offload.pipeline._pipeline.x",
        "opt._pipeline", "opt._slabs", "opt._items", "opt._pipeline", "thing.sub._count", "opt._slabs",
        "offload.pipeline._pipeline.fused_adamw_", "offload.pipeline._pipeline.fused_adamw_",
        "offload.pipeline._pipeline.new_item", "offload.threads._plan.thread_limit", "offload.pipeline._pipeline.Pipeline",
        "offload.pipeline._pipeline.Launch", "offload.threads._numa", "offload.pipeline._pipeline.Worker", "offload.state._items.KINDS",
        "offload.pipeline._pipeline.fused_adamw_", "offload.state._slabs.plan_chunks", "offload.kernels._adamw.fused_adamw_",
        "offload.threads._plan._exchange", "offload.pipeline._pipeline.Queue", "offload.threads._plan.thread_limit",
        "offload.threads._numa.bind", "offload.state._slabs.HostSlabs", "offload._stock.thread_plan"]


def test_the_architecture_doc_states_the_counted_graphs() -> None:
    """docs/architecture.md says how many top-level nodes, layers and import edges ``offload``'s
    and ``autotune``'s graphs have, "counted as tests/test_code_shape.py counts it": the
    figures it states are the ones counted here, so a change to the graph updates the picture."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    stated = re.findall(r"(\d+) top-level nodes, (\d+) layers, (\d+) import edges", text)
    counted = []
    for package in ("offload", "autotune"):
        graph = _top_graph(package)
        counted.append((str(len(graph)), str(_layers(graph)), str(sum(len(t) for t in graph.values()))))
    assert stated == counted, f"docs/architecture.md states {stated}; counted (offload, autotune): {counted}"
