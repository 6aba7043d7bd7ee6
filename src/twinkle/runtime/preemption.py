"""Preemption: SIGTERM asks the run to save a checkpoint at the next step boundary and exit with
``PREEMPTED_EXIT_CODE``, so that a scheduler can requeue it with ``--resume-from-checkpoint auto``.

``initialize()`` installs the handler (in the main thread; elsewhere a signal cannot be caught
and SIGTERM keeps its default). ``TransformersModel.clip_grad_and_step`` asks ``requested()``
after each optimizer step; under several processes the ranks agree on it in the step's own
all-reduce, so they all save the same step. A second SIGTERM ends the process at once."""

import signal
import threading

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the job may be retried"
PREEMPTED_EXIT_CODE = 75

_state = {"requested": False, "installed": False}


def _on_sigterm(signum: int, frame: object) -> None:
    if _state["requested"]:  # the second one: no more waiting for a step boundary
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    _state["requested"] = True


def install() -> None:
    """Catch SIGTERM for this process (once; a no-op outside the main thread)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _state["installed"] = True


def requested() -> bool:
    return _state["requested"]


def clear() -> None:
    _state["requested"] = False
