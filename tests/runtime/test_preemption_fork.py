"""A forked child of a process that catches SIGTERM still dies by SIGTERM, even while it is stuck
in native code where no Python handler can run (a pool's ``terminate()`` must end its workers)."""

import signal
import subprocess
import sys
import textwrap

CHILD_STUCK_IN_C = textwrap.dedent(
    """
    import ctypes, os, signal, sys, time
    from twinkle.runtime import preemption

    preemption.install()
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    assert libc.pthread_mutex_lock(mutex) == 0  # held across the fork: the child blocks in C
    pid = os.fork()
    if pid == 0:
        libc.pthread_mutex_lock(mutex)
        os._exit(0)
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
            sys.exit(0)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("still alive after SIGTERM")
    """
)


def test_a_forked_child_stuck_in_native_code_dies_by_sigterm():
    done = subprocess.run(
        [sys.executable, "-c", CHILD_STUCK_IN_C], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"signal {int(signal.SIGTERM)}"
