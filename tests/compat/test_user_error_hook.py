"""An uncaught ``UserError`` prints as one line (``error: <message>``, exit status 2) in any script
that imports Twinkle, a script that builds no ``CLI`` and a refusal before ``initialize()``
included; every other exception keeps its traceback, through the hook that was there before."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )


def test_an_uncaught_user_error_is_one_line_with_status_2_and_exit_handlers_run():
    done = _run(
        """
        import atexit, sys
        import twinkle
        from twinkle.utils.errors import UserError
        print("hook untouched by import:", sys.excepthook is sys.__excepthook__)
        atexit.register(lambda: print("exit handler ran"))
        raise UserError("the mesh asks for 3\\n  processes")
        """
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == "error: the mesh asks for 3 processes\n"
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines() == ["hook untouched by import: True", "exit handler ran"]


def test_a_mesh_refused_before_initialize_is_one_line():
    done = _run(
        """
        import twinkle
        twinkle.DeviceMesh.from_sizes(fsdp_size=0)
        """
    )
    assert (done.returncode, done.stderr) == (2, "error: --fsdp-size must be at least 1, got 0\n")


def test_other_exceptions_keep_their_traceback_through_the_previous_hook():
    done = _run(
        """
        import sys
        import twinkle
        from twinkle.utils.errors import UserError

        def mine(kind, exc, tb):
            print("script hook:", kind.__name__, file=sys.stderr)
            sys.__excepthook__(kind, exc, tb)

        sys.excepthook = mine
        try:
            raise UserError("caught, so nothing is printed")
        except UserError:
            pass
        raise ValueError("plain bad value")
        """
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "script hook: ValueError"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: plain bad value"


def test_a_twinkle_hook_behind_rays_driver_hook_is_kept(monkeypatch):
    """Importing Ray puts its driver hook in front of the one it found (the Ray controller's); a
    UserError created then leaves both in place, so the controller still stops the cluster first."""
    import types

    from twinkle.utils import errors

    def controller_hook(kind, exc, tb):
        pass

    controller_hook.__module__ = "twinkle.runtime.controller"

    def ray_hook(kind, exc, tb):
        controller_hook(kind, exc, tb)

    ray_hook.__module__ = "ray._private.worker"
    monkeypatch.setitem(
        sys.modules, "ray._private.worker", types.SimpleNamespace(normal_excepthook=controller_hook)
    )
    monkeypatch.setattr(sys, "excepthook", ray_hook)
    errors.UserError("a refusal")
    assert sys.excepthook is ray_hook

    monkeypatch.setattr(sys.modules["ray._private.worker"], "normal_excepthook", sys.__excepthook__)
    errors.UserError("a refusal")
    assert sys.excepthook.__name__ == "user_error_hook"  # Ray's hook in front of Python's: put in front


def test_debug_hands_initialize_a_hook_that_keeps_the_traceback(monkeypatch, tmp_path, capsys):
    """``--debug``: ``initialize`` installs a hook of Twinkle's that prints every traceback, a
    UserError's included, so the one-line hook is not put in front of it."""
    from twinkle.cli import CLI
    from twinkle.runtime.run_config import take_handed_over
    from twinkle.utils import errors

    monkeypatch.setattr(sys, "argv", ["train.py", "--debug", "--output-dir", str(tmp_path / "out")])
    CLI.from_args()
    hook = take_handed_over().excepthook
    monkeypatch.setattr(sys, "excepthook", hook)
    errors.UserError("a refusal")
    assert sys.excepthook is hook
    try:
        raise errors.UserError("a refusal")
    except errors.UserError as exc:
        hook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and err.strip().endswith("UserError: a refusal")
