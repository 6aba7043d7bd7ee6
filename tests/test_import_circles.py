"""No import circle between the modules of ``twinkle`` and ``twinkle_client``.

``tests/test_imports.py`` checks the tiers between packages; this checks the modules inside them.
The graph is built from the source with ``ast`` (nothing is imported), one node per file
(``pkg/__init__.py`` is the node ``pkg``), and a circle is a strongly connected component with
more than one module.

An edge is drawn for

- ``import a.b.c``: to ``a.b.c`` (or to the longest prefix of it that is a module);
- ``from a.b import c``: to ``a.b.c`` when ``c`` is a submodule, else to ``a.b`` (whose
  ``__init__`` defines or re-exports ``c``);
- relative imports, resolved against the importing module's package the same way;
- imports inside functions and classes too: a function-level import hides a circle from the
  interpreter, not from the design. Imports under ``if TYPE_CHECKING:`` are skipped (they never run).

The packages that ``import a.b.c`` initializes on the way (``a``, ``a.b``) get no edge: every
submodule would otherwise loop through an ``__init__`` that re-exports it. A submodule that
imports a *name* from its own package (``from twinkle.x import Y`` inside ``twinkle.x.sub``) does
get the edge ``twinkle.x.sub -> twinkle.x``, and it closes a circle whenever ``twinkle.x``
re-exports ``sub`` (directly or through a sibling): that is counted as a circle. A submodule
imports the sibling module that defines ``Y``, never its own package's ``__init__``; the
package's ``__init__`` is for the package's users.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("twinkle", "twinkle_client", "twinkle_agentic")


def _modules(src: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module under ``src/<package>``, by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for package in packages:
        for path in (src / package).rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules``; None outside them."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def _targets(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules among ``modules`` that ``module`` (the file ``path``) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {_known(alias.name, modules) for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if not is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules else _known(base, modules))
    found.discard(None)
    found.discard(module)
    return found


def import_graph(src: Path = SRC, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = _modules(src, packages)
    return {module: _targets(module, path, modules) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_no_import_circle_between_modules():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(c, graph) for c in found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    src = _tree(
        tmp_path,
        {
            "p/__init__.py": "",
            "p/a.py": "from p.b import f\n",
            "p/b.py": "def f():\n    from .a import g\n",
            "p/c.py": "import p.a\n",
        },
    )
    assert circles(import_graph(src, ("p",))) == [["p.a", "p.b"]]


def test_the_checker_skips_type_checking_and_resolves_relative_imports(tmp_path):
    src = _tree(
        tmp_path,
        {
            "p/__init__.py": "from .q import sub\n",
            "p/q/__init__.py": "",
            "p/q/sub.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import x\nfrom .. import r\n",
            "p/r.py": "import os\nfrom . import q\n",
        },
    )
    graph = import_graph(src, ("p",))
    assert graph == {"p": {"p.q.sub"}, "p.q": set(), "p.q.sub": {"p.r"}, "p.r": {"p.q"}}
    assert circles(graph) == []


def test_a_submodule_importing_a_name_from_its_own_package_is_a_circle(tmp_path):
    src = _tree(
        tmp_path,
        {
            "p/__init__.py": "from .a import A\nfrom .b import B\n",
            "p/a.py": "A = 1\n",
            "p/b.py": "from p import A\nB = A\n",
        },
    )
    assert circles(import_graph(src, ("p",))) == [["p", "p.b"]]
