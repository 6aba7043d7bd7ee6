"""``UserError``: bad input from the user (flags, paths, data rows, checkpoints).

It subclasses ``ValueError`` so callers can catch either. An uncaught ``UserError`` prints as one
line, ``error: <message>``, without a traceback:

- in a run whose command line ``twinkle.cli.CLI`` parsed, by the CLI's hook, which ``initialize()``
  installs (``--debug`` keeps the traceback), and in a single-controller run by the controller's
  hook, after the run's summary or the cluster's shutdown; the exit status is then 1;
- anywhere else (a mesh built from inconsistent sizes before ``initialize()``, a script that builds
  no ``CLI``) by ``install_user_error_hook``'s hook, which the first ``UserError`` created puts in
  front of whatever ``sys.excepthook`` is set, and which keeps handling every other exception;
  the exit status is 2, a refused command line's. ``import twinkle`` itself changes nothing in
  the process."""

import atexit
import os
import sys
import threading
from typing import Any

# What the CLI prints (after ``error: ``) when Ctrl-C stops a run or a command; the exit status is 130.
INTERRUPTED = "interrupted"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a process stopped by Ctrl-C
EXIT_USER_ERROR = 2  # the status of a refused command line (argparse's, and the CLI's)


class UserError(ValueError):
    """A mistake the user can fix; the message says what is wrong and how to fix it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        install_user_error_hook()


def one_line(exc: BaseException) -> str:
    """``error: <message>``, the message's whitespace (newlines included) folded to single spaces."""
    return f"error: {' '.join(str(exc).split())}"


def install_user_error_hook() -> None:
    """Make ``sys.excepthook`` print an uncaught ``UserError`` as one line and exit with status 2.

    A hook of Twinkle's own (this one, the CLI's, the Ray controller's, also behind Ray's driver
    hook) already prints it so and is kept; any other hook (Python's, or one the script set)
    becomes the fallback for every other exception."""
    previous = sys.excepthook
    if _prints_user_errors(previous):
        return

    def user_error_hook(kind: type, exc: BaseException, tb: Any) -> None:
        if not isinstance(exc, UserError):
            previous(kind, exc, tb)
            return
        print(one_line(exc), file=sys.stderr)
        if not hasattr(sys, "ps1"):  # the interactive interpreter reports and goes on
            _exit(EXIT_USER_ERROR)

    sys.excepthook = user_error_hook


def _prints_user_errors(hook: Any) -> bool:
    """Whether ``hook`` is one of Twinkle's, or Ray's driver hook in front of one of Twinkle's:
    importing Ray puts its hook (which records the error for the cluster) in front of the hook
    found then, and calls that one after it."""
    module = getattr(hook, "__module__", None) or ""
    if module.startswith("twinkle."):
        return True
    if module == "ray._private.worker":
        behind = getattr(sys.modules.get(module), "normal_excepthook", None)
        return behind is not None and behind is not hook and _prints_user_errors(behind)
    return False


def _exit(status: int) -> None:
    """End the process as the interpreter ends it after an uncaught exception (non-daemon threads
    joined, ``atexit`` handlers run, output flushed), with ``status`` instead of 1."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the script
            pass
    os._exit(status)
