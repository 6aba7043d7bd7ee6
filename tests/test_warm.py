"""``tests/assets/warm.py`` gives the run a fresh interpreter gives: the script tests rely on it."""

import os
import subprocess
import sys
import textwrap

import pytest
import warm

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys
    import helper  # next to the script: sys.path[0] is the script's folder

    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("TWINKLE_PROBE"),
                      "name": __name__, "file": __file__, "helper": helper.VALUE}))
    print("to stderr", file=sys.stderr)
    how = sys.argv[1]
    if how == "exit-code":
        sys.exit(3)
    if how == "exit-message":
        sys.exit("stopped: a message")
    if how == "hook":
        sys.excepthook = lambda kind, exc, tb: print(f"error: {exc}", file=sys.stderr)
    if how in ("hook", "raise"):
        def deeper():
            raise ValueError("bad row")
        deeper()
    """
)


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 7\n")
    path = folder / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("how", ["ok", "exit-code", "exit-message", "hook", "raise"])
def test_a_warm_run_is_a_fresh_run(script, tmp_path, how):
    # The environment of the script tests (one warm process serves them all); TWINKLE_ variables
    # are per run.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TWINKLE_PROBE": how}
    fresh = subprocess.run(
        [sys.executable, str(script), how], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    forked = warm.run([str(script), how], cwd=tmp_path, env=env, timeout=60)
    assert forked.returncode == fresh.returncode == {"exit-code": 3, "ok": 0}.get(how, 1)
    assert forked.stdout == fresh.stdout
    assert '"helper": 7' in forked.stdout and '"name": "__main__"' in forked.stdout
    assert forked.stderr == fresh.stderr  # the traceback too: it starts at the script
    if how == "raise":
        assert forked.stderr.splitlines()[2].startswith(f'  File "{script}", line ')


def test_merged_output_and_a_timeout(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\nprint('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    merged = warm.run([str(script)], cwd=tmp_path, env=env, merge=True)
    assert merged.stdout == "out\nerr\n" and merged.stderr is None
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        warm.run([str(script)], cwd=tmp_path, env=env, timeout=2)
    assert caught.value.output == "started\n"


def test_a_preload_that_prints_means_a_fresh_interpreter(tmp_path, monkeypatch):
    """Output of the preloading would be missing from the script's: such a warm process is not used."""
    (tmp_path / "noisy.py").write_text("import sys\nprint('imported noisy', file=sys.stderr)\n")
    script = tmp_path / "probe.py"
    script.write_text("import os, noisy\nprint(os.getpid() != int(os.environ['TWINKLE_PARENT']))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TWINKLE_PARENT": str(os.getpid())}
    monkeypatch.setattr(warm, "PRELOAD", ("noisy",))
    result = warm.run([str(script)], cwd=tmp_path, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "True\n", "imported noisy\n")
    assert [w for k, w in warm._warm.items() if ("PYTHONPATH", str(tmp_path)) in k] == [None]


def test_a_run_that_cannot_start_fails_with_its_reason_and_the_next_one_runs(tmp_path):
    """A missing working folder: the child reports it and exits; it does not go on serving."""
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    assert warm.run([str(script)], cwd=tmp_path, env=env).stdout == "hello\n"
    failed = warm.run([str(script)], cwd=tmp_path / "missing", env=env, timeout=60)
    assert failed.returncode == 1 and failed.stdout == ""
    assert (
        f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path / 'missing'}'" in failed.stderr
    )
    assert warm.run([str(script)], cwd=tmp_path, env=env, timeout=60).stdout == "hello\n"


@pytest.mark.parametrize("fresh", [False, True])
def test_stderr_to_a_file_as_it_goes_and_the_pid_to_signal(tmp_path, fresh):
    """``stderr_to`` holds what the run wrote so far while it runs; ``on_start`` gets the process
    that runs the script: SIGKILL to it ends the run with -9, as ``subprocess`` reports."""
    import signal
    import threading
    import time

    script = tmp_path / "waits.py"
    script.write_text(
        "import os, sys, time\nprint(os.getpid(), file=sys.stderr, flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log, pids, result = tmp_path / "stderr.log", [], {}

    def run():
        result["done"] = warm.run(
            [str(script)],
            cwd=tmp_path,
            env=env,
            timeout=120,
            fresh=fresh,
            stderr_to=log,
            on_start=pids.append,
        )

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pids and log.read_text() == f"{pids[0]}\n"  # written while the script still runs
    os.kill(pids[0], signal.SIGKILL)
    runner.join(timeout=60)
    assert not runner.is_alive()
    done = result["done"]
    assert done.returncode == -signal.SIGKILL and done.stderr == f"{pids[0]}\n"
