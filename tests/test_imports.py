"""The package's imports flow one way (ARCHITECTURE section 2) and ``import twinkle`` changes
nothing in the process."""

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "twinkle"
# lowest first; a package may import its own tier's packages (no cycle) and any lower tier's
TIERS = [
    {"utils", "patch"},  # a patch changes the model object it is given; it imports only utils
    {"data_format"},
    {"distributed"},
    {"runtime"},
    {
        "hub",
        "dataset",
        "preprocessor",
        "template",
        "processor",
        "dataloader",
        "kernel",
        "loss",
        "optim",
        "metric",
        "checkpoint",
        "advantage",
        "reward",
    },
    {"model", "export", "sampler", "checkpoint_engine"},
    {"cli", "server"},  # the server imports no cli module; `twinkle server` starts it
]
TIER = {package: level for level, packages in enumerate(TIERS) for package in packages}


def _imports(path: Path) -> set[str]:
    """The twinkle packages a file imports, at module level or inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "twinkle" and len(parts) > 1:
                found.add(parts[1])
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {package: set() for package in TIER}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        if len(rel) == 1:  # the facade, twinkle/__init__.py
            continue
        graph[rel[0]] |= _imports(path) - {rel[0]}
    return graph


def test_every_package_has_a_tier():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(TIER)


def test_no_upward_import():
    upward = [
        f"{package} -> {target}"
        for package, targets in _graph().items()
        for target in targets
        if TIER[target] > TIER[package]
    ]
    assert not upward, "imports against the direction utils -> ... -> cli: " + ", ".join(sorted(upward))


def test_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, target]))
            if target not in state:
                visit(target, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from twinkle.model import TransformersModel\n    import twinkle.cli.cli\n")
    assert _imports(bad) == {"model", "cli"}


def test_only_cli_reads_the_parsed_command_line():
    readers = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.relative_to(SRC).parts[0] != "cli" and "from_args" in path.read_text(encoding="utf-8")
    ]
    assert not readers


def test_import_twinkle_has_no_side_effects():
    # third-party imports first: transformers sets TORCHINDUCTOR_CACHE_DIR when imported
    code = (
        "import os, torch, transformers.modeling_utils, peft, datasets\n"
        "env, threads = dict(os.environ), torch.get_num_threads()\n"
        "flags = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())\n"
        "import twinkle, twinkle.kernel, twinkle.model, twinkle.cli\n"
        "assert env == dict(os.environ), set(os.environ.items()) ^ set(env.items())\n"
        "assert threads == torch.get_num_threads()\n"
        "assert flags == (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())\n"
        "import sys\n"
        "assert 'ray' not in sys.modules  # an optional extra: only --mode ray imports it\n"
        "bad = [m for m in ('fastapi', 'uvicorn', 'tinker') if m in sys.modules]\n"
        "assert not bad, bad  # the server extra: only `twinkle server` imports it\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


PARSE_THEN_INITIALIZE = """
import os, signal, sys, tempfile
from pathlib import Path
import torch
out = Path(tempfile.mkdtemp()) / "out"
sys.argv = ["train.py", "--seed", "7", "--skip-bad-rows", "--max-grad-norm", "0.5", "--output-dir", str(out)]
state = lambda: (sys.excepthook, signal.getsignal(signal.SIGTERM), torch.random.get_rng_state().sum().item())
import twinkle
from twinkle.cli import CLI
from twinkle.dataset import Dataset
from twinkle.runtime import RunDefaults, run_defaults
before = state()
args = CLI.from_args()
assert args.infra.seed == 7 and args.dataset.skip_bad_rows
assert state() == before, "parsing changed the process"
assert run_defaults() == RunDefaults() and Dataset().skip_bad_rows is False
assert not out.exists(), "parsing created the output dir"
runtime = twinkle.initialize()
hook, sigterm, rng = state()
assert hook is not before[0] and sigterm is not before[1] and rng != before[2]
assert runtime.seed == 7 and runtime.defaults.max_grad_norm == 0.5 and runtime.defaults is run_defaults()
assert Dataset().skip_bad_rows is True and Dataset(skip_bad_rows=False).skip_bad_rows is False
assert (out / ".twinkle.lock").exists(), "initialize did not lock the run's output dir"
"""


def test_parsing_the_command_line_changes_nothing_until_initialize():
    """``CLI.from_args()`` only parses; ``initialize()`` applies the run (excepthook, SIGTERM
    handler, seeds, configuration, output-dir lock), in a fresh process as a script runs."""
    done = subprocess.run(
        [sys.executable, "-c", PARSE_THEN_INITIALIZE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
