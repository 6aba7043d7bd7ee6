"""Every call op runs through ``registry.dispatch`` (``kernel/README.md``: "Call ops ... chosen at
each call by ``registry.dispatch``"), read from the source with ``ast``.

A call op is computed right when its chain decides what runs: ``dispatch(op, runners, ...)`` walks
the chain and calls one runner per backend. Code that asks whether a backend is usable and then
calls that backend itself, or that calls a runner directly, skips the chain: a chain edited with
``set_call_chains`` or ``TWINKLE_KERNELS=none`` no longer changes what it runs. Three checks over
``src/``, on a static call graph (module functions and methods; a call is resolved through the
module's imports, ``self.``, a module-level class, or a name of the module; an unresolved call is
no edge, so the graph errs towards missing a path, never towards inventing one):

1. each op the registry knows has at least one ``dispatch`` call naming it (a string, or a module
   constant such as ``OP``), and each such call's runners (a dict written in the source) have one
   entry per backend registered for the op;
2. no function calls a runner (a value of such a dict, or a function a runner lambda calls)
   directly: runners run only when ``dispatch`` calls them;
3. a backend's gate (``registry.enabled``, ``chain``, ``state``, ``order``, ``is_available``: "is this
   backend usable now?") is asked only in code a runner reaches. Every function from which a
   gate is reached by calls (its callers, their callers, ...) must itself be reachable from some
   runner. ``ASKS_OUTSIDE_DISPATCH`` names the few that ask without computing the op.

The checks read source only; a dynamic call (``getattr``, a callback) is invisible to them.
"""

import ast
from dataclasses import dataclass, field
from pathlib import Path

import twinkle.kernel  # noqa: F401  (registers every call op's backends)
from twinkle.kernel import registry

SRC = Path(__file__).resolve().parents[2] / "src"
REGISTRY = "twinkle.kernel.registry"
GATES = {f"{REGISTRY}:{name}" for name in ("enabled", "chain", "state", "order", "is_available")}
DISPATCH = f"{REGISTRY}:dispatch"

# Functions that ask a gate outside any dispatch, and why that is not a choice of backend.
ASKS_OUTSIDE_DISPATCH = {
    # ``twinkle kernels``: prints what each chain resolves to, runs nothing
    "twinkle.kernel.report:*": "reports the chains",
    # builds the ``packed`` backend's weight copies before any call; computes no product
    "twinkle.kernel.cpu_gemm:pack_frozen": "prepares a backend's data",
}


@dataclass
class Module:
    name: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    consts: dict[str, str] = field(default_factory=dict)  # module-level NAME = "string"
    dicts: dict[str, ast.Dict] = field(default_factory=dict)  # module-level NAME = {...}
    defs: set[str] = field(default_factory=set)  # "func", "Class", "Class.method"


def _modules() -> dict[str, Module]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mod = Module(name, ast.parse(path.read_text(encoding="utf-8")))
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = f"{base.strip('.')}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    mod.imports[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        for node in mod.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                mod.defs.add(node.name)
            elif isinstance(node, ast.ClassDef):
                mod.defs.add(node.name)
                mod.defs.update(
                    f"{node.name}.{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                )
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                target, value = node.targets[0].id, node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    mod.consts[target] = value.value
                elif isinstance(value, ast.Dict):
                    mod.dicts[target] = value
        out[name] = mod
    return out


MODULES = _modules()


def _symbol(dotted: str) -> str | None:
    """``pkg.mod.name`` -> ``pkg.mod:name`` where ``pkg.mod`` is a module of ``src/``; a module
    itself -> its name."""
    if dotted in MODULES:
        return dotted
    mod, _, name = dotted.rpartition(".")
    if mod in MODULES:
        return dotted if f"{mod}.{name}" in MODULES else f"{mod}:{name}"
    return None


def resolve(mod: Module, node: ast.expr, cls: str | None = None) -> str | None:
    """What ``node`` names: ``module:Name``/``module:Class.method``, a module, or None."""
    if isinstance(node, ast.Name):
        if node.id in mod.defs or node.id in mod.consts or node.id in mod.dicts:
            return f"{mod.name}:{node.id}"
        if node.id in mod.imports:
            return _symbol(mod.imports[node.id])
        return None
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and cls is not None:
            return f"{mod.name}:{cls}.{node.attr}"
        base = resolve(mod, node.value, cls)
        if base is None:
            return None
        if ":" not in base:  # a module
            return _symbol(f"{base}.{node.attr}")
        return f"{base}.{node.attr}"  # Class.method
    return None


def constant(mod: Module, node: ast.expr) -> str | None:
    """The string ``node`` is: a literal or a module constant (``OP``, ``decode_step.OP``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    target = resolve(mod, node)
    if target and ":" in target:
        owner, _, name = target.partition(":")
        return MODULES[owner].consts.get(name)
    return None


def _functions() -> dict[str, tuple[Module, ast.AST, str | None]]:
    """Every module-level function and method: ``module:qualname`` -> (module, node, class)."""
    out = {}
    for mod in MODULES.values():
        for node in mod.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out[f"{mod.name}:{node.name}"] = (mod, node, None)
            elif isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                        out[f"{mod.name}:{node.name}.{f.name}"] = (mod, f, node.name)
    return out


FUNCTIONS = _functions()


def calls(mod: Module, node: ast.AST, cls: str | None) -> set[str]:
    """What the calls inside ``node`` (nested functions and lambdas included) resolve to."""
    return {
        target
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and (target := resolve(mod, call.func, cls)) is not None
    }


GRAPH = {name: calls(mod, node, cls) for name, (mod, node, cls) in FUNCTIONS.items()}


@dataclass
class Site:
    where: str  # function making the dispatch call
    op: str | None
    runners: dict[str, set[str]] | None  # backend -> the functions that run it


def _runners(mod: Module, node: ast.expr) -> dict[str, set[str]] | None:
    """A runners dict written in the source: backend -> the function it names, or those its lambda
    calls."""
    table = node
    if not isinstance(node, ast.Dict):
        target = resolve(mod, node)
        owner, _, name = (target or "").partition(":")
        if owner not in MODULES or name not in MODULES[owner].dicts:
            return None
        mod, table = MODULES[owner], MODULES[owner].dicts[name]
    out = {}
    for key, value in zip(table.keys, table.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return None
        if isinstance(value, ast.Lambda):
            out[key.value] = calls(mod, value, None)
        else:
            target = resolve(mod, value)
            out[key.value] = {target} if target else set()
    return out


def _sites() -> list[Site]:
    sites = []
    for name, (mod, node, cls) in FUNCTIONS.items():
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and resolve(mod, call.func, cls) == DISPATCH:
                op = constant(mod, call.args[0]) if call.args else None
                runners = _runners(mod, call.args[1]) if len(call.args) > 1 else None
                sites.append(Site(name, op, runners))
    return sites


SITES = _sites()
RUNNERS = {f for site in SITES for fs in (site.runners or {}).values() for f in fs if f in FUNCTIONS}


def test_the_source_reader_finds_what_it_must():
    """The checks below are only as good as the call graph: it sees the known dispatch sites."""
    where = {site.where for site in SITES}
    assert {"twinkle.kernel.cpu_gemm:linear", "twinkle.kernel.gemv:few_rows"} <= where
    assert "twinkle.kernel.cpu_gemm:_onednn_linear" in RUNNERS
    assert "twinkle.kernel.gemv:native" in RUNNERS  # named by a lambda of the runners dict


def test_every_call_op_is_dispatched_with_a_runner_per_backend():
    problems = []
    for site in SITES:
        if site.op is None:
            problems.append(f"{site.where}: dispatch's op is not a string or a module constant")
        if site.runners is None:
            problems.append(f"{site.where}: dispatch's runners are not a dict in the source")
    for op in registry.registered_call_ops():
        sites = [site for site in SITES if site.op == op]
        if not sites:
            problems.append(f"call op {op!r}: no registry.dispatch({op!r}, ...) anywhere in src/")
        backends = set(registry.backends_of(op))
        problems += [
            f"{site.where}: dispatch of {op!r} has runners for {sorted(site.runners)}, "
            f"but the op's backends are {sorted(backends)}"
            for site in sites
            if site.runners is not None and set(site.runners) != backends
        ]
    assert not problems, "\n".join(problems)


def test_no_code_calls_a_runner_itself():
    direct = sorted(
        f"{caller} calls runner {runner}" for caller, callees in GRAPH.items() for runner in callees & RUNNERS
    )
    assert not direct, "runners run only through registry.dispatch:\n" + "\n".join(direct)


def _allowed(name: str) -> bool:
    module = name.partition(":")[0]
    return name in ASKS_OUTSIDE_DISPATCH or f"{module}:*" in ASKS_OUTSIDE_DISPATCH


def test_backend_gates_are_asked_only_inside_a_dispatch():
    reached, todo = set(RUNNERS), list(RUNNERS)  # what the runners reach, by calls
    while todo:
        for callee in GRAPH.get(todo.pop(), ()):
            if callee in FUNCTIONS and callee not in reached:
                reached.add(callee)
                todo.append(callee)
    callers: dict[str, set[str]] = {}
    for caller, callees in GRAPH.items():
        for callee in callees:
            callers.setdefault(callee, set()).add(caller)
    asking = {f for f, callees in GRAPH.items() if callees & GATES and not f.startswith(f"{REGISTRY}:")}
    assert asking, "no gate found: the reader no longer sees registry.enabled"
    seen, todo = set(asking), list(asking)  # every function from which a gate is reached
    while todo:
        name = todo.pop()
        if _allowed(name):
            continue
        for caller in callers.get(name, ()):
            if caller not in seen:
                seen.add(caller)
                todo.append(caller)
    outside = sorted(f for f in seen - reached if not _allowed(f) and not f.startswith(f"{REGISTRY}:"))
    assert not outside, (
        "these ask whether a backend is usable (registry.enabled & co.) outside any dispatch, i.e. choose "
        "a backend themselves; call registry.dispatch instead:\n" + "\n".join(outside)
    )
