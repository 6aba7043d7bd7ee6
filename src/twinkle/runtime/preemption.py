"""Preemption: SIGTERM during the training loop asks the run to save a checkpoint at the next step
boundary and exit with ``PREEMPTED_EXIT_CODE``, so that a scheduler can requeue it with
``--resume-from-checkpoint auto``. Before the loop there is nothing to save: SIGTERM ends the
process at once, with one line on stderr.

``initialize()`` installs the handler (in the main thread; elsewhere a signal cannot be caught
and SIGTERM keeps its default). The loop begins at the first training forward
(``TransformersModel.forward`` calls ``loop_started()``); from then on the handler only sets a
flag, which the model's optimizer step asks ``requested()`` about (in the window's all-reduce,
and at ``zero_grad`` it saves); under several processes the ranks agree on it in the step's own all-reduce, so
they all save the same step. A second SIGTERM ends the process at once.

Ending at once means dying by SIGTERM with its default action (exit status 143 in a shell), as a
process without a handler would: a set-up blocked on a stalled mount or a FIFO must not keep the
process alive, and ``finally`` blocks or ``atexit`` handlers could block in the same way. A
forked child (a ``DataLoader`` or ``datasets.map`` worker) starts with SIGTERM's default action
again: a Python handler runs only between bytecodes, so a child stuck in native code (a lock
held by a thread of the parent at the fork) would outlive its pool's ``terminate()`` and hang
the parent's ``join``."""

import os
import signal
import threading

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the job may be retried"
PREEMPTED_EXIT_CODE = 75
BEFORE_LOOP_MESSAGE = "error: stopped by SIGTERM before the first training step (nothing to save)"

_state = {"requested": False, "installed": False, "in_loop": False, "pid": 0, "say": True}


def _die_by_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _state["pid"]:  # a forked child: its parent decides about checkpoints
        _die_by_sigterm()
    if not _state["in_loop"]:
        try:
            if _state["say"]:
                os.write(2, (BEFORE_LOOP_MESSAGE + "\n").encode())
        except OSError:  # stderr closed: the exit status still says SIGTERM
            pass
        _die_by_sigterm()
    if _state["requested"]:  # the second one: no more waiting for a step boundary
        _die_by_sigterm()
    _state["requested"] = True


def _default_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def install(say_before_loop: bool = True) -> None:
    """Catch SIGTERM for this process (once; a no-op outside the main thread).
    ``say_before_loop=False``: a SIGTERM before the loop ends the process without the line, for a
    Ray group's worker, whose driver reports the job and ends the groups that never train (a
    sampler) with SIGTERM when the job is done."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _state["say"] = say_before_loop
    _state["pid"] = os.getpid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.register_at_fork(after_in_child=_default_in_child)
    _state["installed"] = True


def loop_started() -> None:
    """The training loop runs: a SIGTERM from now on saves a checkpoint at the next step boundary."""
    _state["in_loop"] = True


def in_loop() -> bool:
    return _state["in_loop"]


def requested() -> bool:
    return _state["requested"]


def clear() -> None:
    _state["requested"] = False
