"""The server's layout, read from its source with ``ast`` (nothing is imported):

- no module of ``twinkle.server`` imports a module that imports it back, directly or through a
  chain; an import inside a function counts as much as one at the top of the module;
- no route or exception handler is defined inside a function: each is a module-level function
  of its route module (``twinkle.server.routes``), which reaches the app's state through the
  request, so a reader finds a route by its module and name.

An edge ``a -> b`` is drawn for ``import b`` and ``from b import x`` (to ``b.x`` when that is a
module), relative imports resolved; the packages Python initializes on the way get no edge."""

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "src" / "twinkle" / "server"
PACKAGE = "twinkle.server"
# decorators and registrations that make a function a handler
ROUTE_DECORATORS = {
    "get",
    "post",
    "put",
    "delete",
    "patch",
    "head",
    "options",
    "api_route",
    "route",
    "websocket",
}
HANDLER_DECORATORS = ROUTE_DECORATORS | {"exception_handler", "middleware"}
REGISTRATIONS = {"add_api_route", "add_route", "add_exception_handler", "add_middleware"}


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix among ``modules``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_graph(root: Path = SERVER, package: str = PACKAGE) -> dict[str, set[str]]:
    """Each module -> the modules of the package it imports, at any depth of its source."""
    modules = _modules(root, package)
    graph = {}
    for module, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {_known(alias.name, modules) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = module.split(".")[: None if path.name == "__init__.py" else -1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else _known(base, modules))
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each module's shortest import chain back to itself, one per circle (sorted members)."""
    found = {}
    for start in sorted(graph):
        paths, seen = [[start]], {start}
        while paths:  # breadth first: the shortest way back
            path = paths.pop(0)
            for target in sorted(graph[path[-1]]):
                if target == start:
                    found.setdefault(tuple(sorted(path)), [*path, start])
                    paths = []
                    break
                if target not in seen:
                    seen.add(target)
                    paths.append([*path, target])
    return sorted(found.values())


def nested_handlers(root: Path = SERVER, package: str = PACKAGE) -> list[str]:
    """``module:line name`` of each handler defined inside a function: one decorated as a route
    or exception handler, one a registration call inside the function names, or any coroutine
    function defined inside another function (an endpoint factory)."""
    found = []
    for module, path in _modules(root, package).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for outer in ast.walk(tree):
            if not isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            inner = [
                n
                for n in ast.walk(outer)
                if n is not outer and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
            registered = {
                arg.id
                for call in ast.walk(outer)
                if isinstance(call, ast.Call) and _attr(call.func) in REGISTRATIONS
                for arg in call.args
                if isinstance(arg, ast.Name)
            }
            for fn in inner:
                decorated = any(
                    _attr(d.func if isinstance(d, ast.Call) else d) in HANDLER_DECORATORS
                    for d in fn.decorator_list
                )
                if decorated or fn.name in registered or isinstance(fn, ast.AsyncFunctionDef):
                    found.append(f"{module}:{fn.lineno} {fn.name} (inside {outer.name})")
    return sorted(set(found))


def _attr(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else None


def test_no_module_of_the_server_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_every_route_handler_is_defined_at_module_level():
    found = nested_handlers()
    assert not found, "handlers defined inside a function:\n" + "\n".join(found)


def test_the_routes_are_the_route_modules_handlers():
    """The checks look where the handlers are: each route module declares a router and
    module-level handlers on it."""
    modules = _modules(SERVER, PACKAGE)
    routes = [m for m in modules if m.startswith(f"{PACKAGE}.routes.")]
    assert routes
    for module in routes:
        tree = ast.parse(modules[module].read_text(encoding="utf-8"))
        assert any(
            isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "router" for t in n.targets)
            for n in tree.body
        ), module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checks_see_a_circle_through_a_function_level_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "__init__.py": "def make():\n    from p.app import create\n",
            "app.py": "from p import routes\n",
            "routes/__init__.py": "from p.routes import a\n",
            "routes/a.py": "from .. import helpers\n",
            "helpers.py": "def f():\n    from p.app import x\n",
            "other.py": "import p.helpers\n",
        },
    )
    graph = import_graph(root, "p")
    assert graph["p.routes.a"] == {"p.helpers"} and graph["p"] == {"p.app"}
    assert circles(graph) == [["p.app", "p.routes", "p.routes.a", "p.helpers", "p.app"]]


def test_the_checks_see_a_handler_inside_a_function(tmp_path):
    root = _tree(
        tmp_path,
        {
            "a.py": "def add(app):\n    @app.post('/x')\n    def x():\n        pass\n",
            "b.py": "def make(what):\n    async def answer(request):\n        return what\n    return answer\n",
            "c.py": "def add(app):\n    def h(request, exc):\n        pass\n    app.add_exception_handler(Exception, h)\n",
            "d.py": "@router.get('/x')\nasync def x():\n    def helper():\n        pass\n",
        },
    )
    assert nested_handlers(root, "p") == [
        "p.a:3 x (inside add)",
        "p.b:2 answer (inside make)",
        "p.c:2 h (inside add)",
    ]
