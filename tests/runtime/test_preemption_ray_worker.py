"""SIGTERM before the training loop: one line in a process of its own; none in a Ray group's
worker (its driver reports the job, and ends the groups that never train, a sampler, with
SIGTERM when the job is done: the line would call a finished run an error)."""

import os
import signal
import subprocess
import sys
import textwrap

from twinkle.runtime.preemption import BEFORE_LOOP_MESSAGE

SELF_SIGTERM = textwrap.dedent(
    """
    import os, signal, time, twinkle

    twinkle.initialize()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    """
)


def _run(tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-c", SELF_SIGTERM],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "TWINKLE_CACHE": str(tmp_path / "cache"), **env},
    )


def test_a_process_of_its_own_says_it(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == -signal.SIGTERM and done.stderr.strip().splitlines()[-1] == BEFORE_LOOP_MESSAGE


def test_a_ray_groups_worker_ends_without_the_line(tmp_path):
    done = _run(tmp_path, TWINKLE_RAY_WORKER="1")
    assert done.returncode == -signal.SIGTERM and BEFORE_LOOP_MESSAGE not in done.stderr
