"""The package's import structure (issue 30), read from the source with ``ast``, nothing
imported: no import circle, none up the layers, no import between two runtimes, no runtime named in
``protocol/``.

What counts as an import of module A by module B: every ``import``/``from ... import``
statement in B that names a module of the package, at module level *or inside a
function* (a function-local import is a dependency all the same; deferring it only
hides a circle until the function runs). ``from pkg import name`` is an import of
``pkg.name`` when that is a module, else of ``pkg``. Not counted: imports under ``if
TYPE_CHECKING:`` (they never run), and the implicit import of a module's parent
packages (``import a.b.c`` runs ``a/__init__`` first; counting that would make every
package that imports its own submodules a circle). A runtime reached through the
registry's ``"module:name"`` strings (:mod:`stalewise.runtime`) is not an import: that
is how the generic layers (``sw.attach``, ``stalewise run``, ``Job.train``) reach a
runtime without depending on it.

Runtimes are the subpackages of ``stalewise/runtime/`` (``local``, ``ray``, ``sim``);
"named in protocol/" means an import of ``stalewise.runtime.*`` or a string constant
(docstrings aside) that is a runtime's name or quotes it (``"'sim'"``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import stalewise

PACKAGE = Path(stalewise.__file__).parent


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _statements(tree: ast.AST):
    """The import statements of a module, outside ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(tree):
        if _type_checking(child):
            for node in child.orelse:
                yield from _statements(node)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _statements(child)


def imports(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module of the package it imports: the line of the first such import}."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                targets = [known(f"{base}.{a.name}") for a in node.names]
            for target in targets:
                if target is not None and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One chain per strongly connected component of more than one module: a closed walk
    through all of it, first module repeated at the end (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_chain(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _chain(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")  # pragma: no cover


def runtimes(root: Path = PACKAGE) -> list[str]:
    """The runtime subpackages' names (``local``, ``ray``, ``sim``)."""
    return sorted(p.parent.name for p in (root / "runtime").glob("*/__init__.py"))


def cross_runtime(graph: dict[str, dict[str, int]], names: list[str], top: str) -> list[str]:
    """``A:LINE imports B`` for each import between two runtimes' subpackages."""

    def runtime_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if parts[:2] == [top, "runtime"] and len(parts) > 2 else None

    return [
        f"{a}:{line} imports {b}"
        for a, edges in sorted(graph.items())
        for b, line in sorted(edges.items())
        if runtime_of(a) in names and runtime_of(b) in names and runtime_of(a) != runtime_of(b)
    ]


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


def runtimes_named_in(
    mods: dict[str, Path], graph: dict[str, dict[str, int]], names: list[str], top: str
) -> list[str]:
    """Each place in ``top.protocol`` that imports a runtime module or names a runtime."""
    found = []
    for module, path in sorted(mods.items()):
        if not (module + ".").startswith(f"{top}.protocol."):
            continue
        found += [
            f"{module}:{line} imports {target}"
            for target, line in sorted(graph[module].items())
            if (target + ".").startswith(f"{top}.runtime.")
        ]
        tree = ast.parse(path.read_text(), str(path))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            if id(node) in skip:
                continue
            text = node.value
            hits = [n for n in names if text == n or f"'{n}'" in text or f'"{n}"' in text]
            if hits:
                found.append(f"{module}:{node.lineno} names runtime {hits[0]!r}: {text!r}")
    return found


#: The layers, bottom to top (docs/design-notes.md, "Layers"), by top-level module or
#: package: a module imports only from its own layer and those below it.
LAYERS = {
    "arrays": ("tree", "backends", "segments", "_lazy"),
    "maths": ("optim", "staleness", "codecs", "_codec_kernels", "targets", "pacing"),
    "protocol": ("protocol", "consistency", "strategies", "sharding", "checkpoint"),
    "runtimes": ("runtime",),
    "ways in": ("launch", "options"),  # stalewise run / sw.init, the option groups
    "surfaces": ("api", "cli", "config", "sweep", "demo", "report", "tasks", "calibrate",
                 "loggers", "loops", "__init__", "__main__"),
}  # fmt: skip

#: Arrows up the layers that other changes of this round remove; each line goes with its arrow.
KNOWN_UP: set[str] = set()  # none: every arrow points down


def upward(graph: dict[str, dict[str, int]], layers: dict[str, tuple[str, ...]]):
    """``A:LINE imports B`` for each import from a lower layer to a higher one, and each
    top-level module no layer names."""
    rank = {name: i for i, names in enumerate(layers.values()) for name in names}

    def layer(module: str) -> int | None:
        return rank.get((module.split(".")[1:] or ["__init__"])[0])

    found = sorted({f"{(a.split('.')[1:] or ['__init__'])[0]} is in no layer"
                    for a in graph if layer(a) is None})  # fmt: skip
    for a, edges in sorted(graph.items()):
        for b, line in sorted(edges.items()):
            if None not in (layer(a), layer(b)) and layer(b) > layer(a):
                found.append(f"{a}:{line} imports {b}")
    return found


GRAPH = imports(modules())


def test_no_import_circle():
    found = circles(GRAPH)
    assert not found, "import circles (all imports, function-local ones too):\n" + "\n".join(
        " -> ".join(chain) for chain in found
    )


def test_no_import_between_two_runtimes():
    names = runtimes()
    assert names == ["local", "ray", "sim"]
    found = cross_runtime(GRAPH, names, "stalewise")
    assert not found, "imports between runtimes:\n" + "\n".join(found)


def test_no_import_points_up_the_layers():
    found = upward(GRAPH, LAYERS)
    unknown = [f for f in found if f"{f.split(':')[0]} -> {f.split()[-1]}" not in KNOWN_UP]
    assert not unknown, "imports from a lower layer to a higher one:\n" + "\n".join(unknown)


def test_protocol_names_no_runtime():
    found = runtimes_named_in(modules(), GRAPH, runtimes(), "stalewise")
    assert not found, "runtimes named in protocol/:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check on a small package that breaks its rule, so none of them passes by
    finding nothing at all."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    import pkg.c\n",  # a function-local import counts
        "pkg/c.py": "from . import a\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pkg.d\n",  # not counted
        "pkg/d.py": "import pkg.c\n",
        "pkg/runtime/__init__.py": "",
        "pkg/runtime/local/__init__.py": "",
        "pkg/runtime/local/x.py": "from pkg.runtime.sim import y\n",
        "pkg/runtime/sim/__init__.py": "",
        "pkg/runtime/sim/y.py": "",
        "pkg/protocol/__init__.py": '"""Says "sim" in a docstring, which is fine."""\n',
        "pkg/protocol/p.py": "import pkg.runtime.local.x\nRUNTIMES = ('sim',)\n"
        "WHY = f\"use runtime 'local' {1}\"\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    mods = modules(tmp_path / "pkg")
    graph = imports(mods)
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    names = runtimes(tmp_path / "pkg")
    assert cross_runtime(graph, names, "pkg") == ["pkg.runtime.local.x:1 imports pkg.runtime.sim.y"]
    layers = {"low": ("a", "b", "runtime", "protocol"), "high": ("c", "d")}
    assert upward(graph, layers) == ["__init__ is in no layer", "pkg.b:2 imports pkg.c"]
    assert runtimes_named_in(mods, graph, names, "pkg") == [
        "pkg.protocol.p:1 imports pkg.runtime.local.x",
        "pkg.protocol.p:2 names runtime 'sim': 'sim'",
        "pkg.protocol.p:3 names runtime 'local': \"use runtime 'local' \"",
    ]
