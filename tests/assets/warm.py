"""Run ``python SCRIPT ARGS`` in a child forked from a process that has already imported torch,
transformers, peft and datasets.

Those imports are most of a short script run: ~10 s a process on CI's two cores, so the suite's
dozens of script runs spend minutes importing. ``run`` gives the same observable run as a fresh
interpreter: the script file runs as ``__main__`` with its ``sys.argv``, ``sys.path[0]``, working
folder, environment and its own stdout/stderr; an uncaught exception goes through
``sys.excepthook`` (the script's, if it set one) with the traceback starting at the script, a
``SystemExit`` sets the exit status as the interpreter does, ``atexit`` handlers run, and the
status is the process's own (negative for a signal, like ``subprocess``).

Exactness is kept by construction, not by hope:
* one warm process per environment, ignoring ``TWINKLE_*`` variables (Twinkle is imported by the
  child, never preloaded) and pytest's ``PYTEST_CURRENT_TEST``, so every variable a preloaded
  library read at import had the value the script's environment gives it;
* anything the preloading printed (an import-time warning) would be the script's output too:
  if there is any, the warm process is not used and the script runs in a fresh interpreter.

The preloaded process has run no torch op and started no Python thread when it forks (importing
torch starts one idle native thread, which the child does not inherit); ``DataLoader`` workers
are forked the same way, after far more."""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Read by Twinkle (imported in the child) or set by pytest per test: not part of a warm process's key.
PER_RUN = ("TWINKLE_", "PYTEST_CURRENT_TEST")
PRELOAD_TIMEOUT_S = 300
PRELOAD = ("torch", "torch.optim", "transformers", "peft", "datasets", "safetensors.torch", "tqdm")

SERVER = r"""
import importlib, json, os, runpy, signal, sys, threading

for name in sys.argv[1:]:
    importlib.import_module(name)
replies = os.fdopen(os.dup(1), "w", buffering=1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)  # stray output of the warm process goes nowhere; the reply channel is its copy
replies.write("ready\n")


def exit_status(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run(request):
    os.setpgid(0, 0)  # its own group: a timeout ends whatever it started
    # Ctrl-C as a shell's child gets it, whatever the test process that started the warm process
    # had ignored or blocked (a disposition and a mask are inherited across fork and exec)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    if request["stderr"] is None:  # merged, as stderr=subprocess.STDOUT
        os.dup2(1, 2)
    else:
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.dup2(null, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next  # the interpreter's traceback starts at the script, not at runpy
        if tb is not None:
            exc.__traceback__ = tb  # what the hook prints, whatever tb it is given
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads before atexit
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            run(request)  # ends the child itself
        except BaseException:  # a failed set-up (a missing cwd): the child must not serve this loop
            import traceback
            traceback.print_exc()
        os._exit(1)
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
"""

_warm: dict[tuple, "_Warm | None"] = {}


class _Warm:
    def __init__(self, env: dict[str, str]):
        self.folder = Path(tempfile.mkdtemp(prefix="twinkle-warm-"))
        preload_err = self.folder / "preload.err"
        with open(preload_err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, *PRELOAD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
                cwd=self.folder,
            )
        stuck = threading.Timer(PRELOAD_TIMEOUT_S, self.proc.kill)  # then unusable: fresh runs
        stuck.start()
        ready = self.proc.stdout.readline().strip()
        stuck.cancel()
        self.usable = ready == "ready" and not preload_err.read_text()

    def run(self, argv, cwd, env, timeout: float, merge: bool, stderr_to=None, on_start=None):
        out, err = self.folder / "stdout", Path(stderr_to or self.folder / "stderr")
        out.write_text("")  # a child that fails before opening them leaves no earlier run's output
        err.write_text("")
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out)}
        request["stderr"] = None if merge else str(err)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply()["pid"]
        if on_start is not None:
            on_start(pid)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        status = self._reply()["status"]
        timer.cancel()
        stdout = out.read_text(errors="replace")
        stderr = None if merge else err.read_text(errors="replace")
        if killed.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, status, stdout, stderr)

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:  # it died (killed, out of memory): say so rather than fail to parse ""
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the warm process exited ({self.proc.returncode}); it printed: "
                               f"{(self.folder / 'preload.err').read_text()[-2000:]!r}")  # fmt: skip
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


def _close_all() -> None:
    for warm in _warm.values():
        if warm is not None:
            warm.close()


atexit.register(_close_all)


def _warm_for(env: dict[str, str]) -> "_Warm | None":
    """The warm process for ``env``, started on first use; None where none can serve it."""
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(PER_RUN)))
    if key not in _warm:
        warm = _Warm(dict(key))
        if not warm.usable:
            warm.close()
        _warm[key] = warm if warm.usable else None
    return _warm[key]


def run(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float = 300,
    merge: bool = False,
    fresh: bool = False,
    stderr_to: Path | None = None,
    on_start=None,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)``, from a warm process when one can give the same run and
    ``fresh`` does not ask for a new interpreter. ``merge``: stderr goes to stdout
    (``stderr=subprocess.STDOUT``). ``stderr_to``: stderr is written to that file as the run
    goes (and returned as well); ``on_start(pid)`` is called with the run's process id once it
    runs (a test may signal it)."""
    warm = None if fresh else _warm_for(env)
    if warm is None and (stderr_to is not None or on_start is not None):
        return _fresh_watched(argv, cwd, env, timeout, merge, stderr_to, on_start)
    if warm is None:
        err = subprocess.STDOUT if merge else subprocess.PIPE
        return subprocess.run(
            [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            timeout=timeout,
        )  # fmt: skip
    return warm.run(argv, cwd, env, timeout, merge, stderr_to, on_start)


def _fresh_watched(argv, cwd, env, timeout, merge, stderr_to, on_start) -> subprocess.CompletedProcess:
    """``run`` in a fresh interpreter with ``stderr_to`` and ``on_start`` honoured."""
    with tempfile.TemporaryDirectory() as folder:
        err_path = Path(stderr_to or Path(folder) / "stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge else err, text=True,
            )  # fmt: skip
            if on_start is not None:
                on_start(proc.pid)
            try:
                stdout, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
                raise
        stderr = None if merge else err_path.read_text(errors="replace")
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, stdout, stderr)
