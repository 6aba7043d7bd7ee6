"""``--max-restarts K`` for a single controller (``controller``): the run is started again.

Under a single controller the loop lives in the driver's script, so a dead rank cannot be
replaced under a loop that is still running: the step it died in is lost on every rank of its
group, the optimizer state of the survivors no longer matches, and the driver's own variables
(the DataLoader's position, the batch in flight) belong to that step. What can be restarted
cleanly is the whole run, from the newest complete checkpoint, as the SPMD ``--mode ray`` does
(``ray_job``). So with ``max_restarts > 0`` the process that called ``initialize`` becomes a
supervisor: it holds the output lock and runs the same script, with the same arguments, as a
child process (an *attempt*) that is the controller. When a rank of an attempt dies, the attempt
stops every group's workers, logs one warning line and exits with ``RESTART_EXIT_CODE``; the
supervisor then starts the next attempt with ``--resume-from-checkpoint auto`` when this run has
written a checkpoint (else from the start), up to K times. Any other exit of an attempt (success,
a ``UserError``, a preemption) is the run's exit. The last attempt that may not restart reports a
dead rank as one ``error:`` line, as a run without restarts does.

Why a child process rather than restarting in place: a restart in place would have to unwind the
user's loop from inside a call, and a re-executed process (``exec``) would skip the script's
``finally`` blocks and lose the interpreter's flags; a child also ends its workers with it (Ray
kills a driver's actors when the driver exits), however it ends. The cost is one more Python
process, and an attempt's start-up (imports, the cluster connection, loading the model) again
for each restart."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twinkle.runtime.ray_job import _restart_argv, _resumable_since
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

ATTEMPT = "TWINKLE_CONTROLLER_RESTARTS_LEFT"  # set in an attempt: how many restarts remain after it
RESTART_EXIT_CODE = 86  # an attempt asks its supervisor for a restart (a rank died)


def restarts_left() -> int | None:
    """In an attempt, the restarts that remain after it; None in any other process."""
    value = os.environ.get(ATTEMPT)
    return int(value) if value and value.isdigit() else None


def supervising(run: Any) -> bool:
    """Whether this driver supervises attempts rather than running the loop itself."""
    return run.max_restarts > 0 and restarts_left() is None


def for_attempt(run: Any) -> Any:
    """``run`` as an attempt takes it: its supervisor holds the output folder's lock."""
    return dataclasses.replace(run, lock_output_dir=False) if restarts_left() is not None else run


def after_death(message: str) -> None:
    """A rank died (``message`` says which): in an attempt with a restart left, log it and exit
    for the supervisor to restart the run; otherwise return (the caller reports it as one line)."""
    left = restarts_left()
    if not left:
        return
    get_logger().warning(f"{message}; restarting the run ({left} restart(s) left)")
    sys.stdout.flush()
    raise SystemExit(RESTART_EXIT_CODE)


def supervise(run: Any) -> int:
    """Run this script as attempts until one ends other than by a dead rank; its exit code."""
    script = sys.argv[0]
    if not script or script == "-c" or not Path(script).is_file():
        raise UserError(
            "--max-restarts with device groups runs the script again after a rank dies; run it from a "
            "file (python script.py ...), or leave --max-restarts 0"
        )
    argv, started = list(sys.argv[1:]), time.time()
    for restart in range(run.max_restarts + 1):
        env = {**os.environ, ATTEMPT: str(run.max_restarts - restart)}
        code = _attempt([sys.executable, script, *argv], env)
        if code != RESTART_EXIT_CODE:
            return code
        if _resumable_since(run.output_dir, started):
            argv = _restart_argv(argv)
    return 1  # not reached: the last attempt has no restart left, so it never asks for one


def _attempt(command: list[str], env: dict[str, str]) -> int:
    """Run one attempt to its end. A SIGTERM sent to this process goes on to it; Ctrl-C reaches
    it from the terminal (it is in this process's group), so here it is only waited out."""
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:  # it has just ended
            pass

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: None),
    }
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
