"""One run per output folder: ``<output_dir>/.twinkle.lock``.

Through the verbatim contract script: a second run into a folder a live run holds is refused in
one line naming the holder's pid and host; once the holder is SIGKILLed the next run takes the
lock over and says so; a clean exit removes the file. In this process: only the folder's owner
(a single process, rank 0, the Ray driver) asks for it, and only for an output dir the CLI parsed."""

import json
import os
import signal
import socket
import subprocess
import time

import pytest
from harness import assert_one_line_error, run_script, script_command, script_env

import twinkle
import twinkle.runtime.ray_job as ray_job
import twinkle.runtime.runtime as runtime_module
from twinkle.cli import CLI
from twinkle.runtime import RunDefaults, get_runtime, output_lock, run_defaults

FAST = ("--train-samples", "4", "--batch-size", "4", "--eval-samples", "4", "--eval-interval", "100")


@pytest.fixture(autouse=True)
def _release_locks(monkeypatch):
    """Whatever a test locks in this process is let go at its end; its runtime is not kept."""
    monkeypatch.setattr(runtime_module, "_RUNTIME", None)
    yield
    output_lock.release_all()


def _holder(lock) -> dict:
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text) if text.strip() else {}


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    lock = out / ".twinkle.lock"
    command = script_command(tiny_model_dir, out, "--train-samples", "64", "--batch-size", "4")
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, cwd=tmp_path, env=script_env(tmp_path), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 180
        while _holder(lock).get("pid") != first.pid:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # alive and holding the lock for as long as the next run takes

        second = run_script(tmp_path, tiny_model_dir, out, *FAST)
        line = assert_one_line_error(
            second,
            rf"--output-dir \S*out is in use by another run \(pid {first.pid} on host "
            rf"{socket.gethostname()}, started [\d: -]+\); wait for it to end, stop it, or choose another",
            tmp_path / "no-output",
        )
        assert "Traceback" not in second.stderr, line
        assert _holder(lock)["pid"] == first.pid  # the refused run left the holder's file alone

        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _holder(lock)["pid"] == first.pid  # a killed run cannot clean up: its file stays

    third = run_script(tmp_path, tiny_model_dir, out, *FAST)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock file left by pid {first.pid} on host {socket.gethostname()}" in third.stderr
    assert not lock.exists()  # a clean exit removes it
    assert (out / "last-checkpoint" / ".twinkle-complete").is_file()


def test_the_lock_is_taken_once_per_process_and_removed_at_exit(tmp_path):
    out = tmp_path / "out"
    CLI.from_args(["--output-dir", str(out)], env={})
    twinkle.initialize(seed=0)
    output_lock.take_for_run(run_defaults(), owner=True)  # again in the same process: nothing to refuse
    holder = _holder(out / ".twinkle.lock")
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    output_lock.release_all()
    assert not (out / ".twinkle.lock").exists()


def test_other_ranks_and_ray_workers_never_ask(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("RANK", "1")  # a rank other than 0 of a torchrun job
    CLI.from_args(["--output-dir", str(out)], env={})
    twinkle.initialize(seed=0)
    assert not out.exists()

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TWINKLE_RAY_WORKER", "1")  # rank 0, but a Ray worker: its driver holds the lock
    CLI.from_args(["--output-dir", str(out)], env={})
    twinkle.initialize(mode="ray", seed=0)
    assert not out.exists()


def test_the_ray_driver_holds_the_lock_while_its_workers_run(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.delenv("TWINKLE_RAY_WORKER", raising=False)
    seen = {}

    def fake_job(mesh, defaults):
        seen.update(_holder(out / ".twinkle.lock"))
        return 0

    monkeypatch.setattr(ray_job, "run_job", fake_job)
    CLI.from_args(["--output-dir", str(out), "--mode", "ray"], env={})
    with pytest.raises(SystemExit):
        twinkle.initialize(mode="ray")
    assert seen["pid"] == os.getpid()


def test_no_lock_without_a_run_that_owns_the_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    twinkle.initialize(seed=0, run=RunDefaults(output_dir=str(out)))  # a script's run that owns no folder
    assert not out.exists()
    CLI.from_args(["--output-dir", str(out)], env={})
    monkeypatch.setattr(runtime_module, "_RUNTIME", None)
    get_runtime()  # started implicitly by a library call, not by the script
    assert not out.exists()
    twinkle.initialize(seed=0)  # the script's initialize applies the parsed command line
    assert (out / ".twinkle.lock").exists()


def test_a_script_without_a_command_line_locks_by_asking(tmp_path):
    out = tmp_path / "out"
    twinkle.initialize(seed=0, run=RunDefaults(output_dir=str(out), lock_output_dir=True))
    assert _holder(out / ".twinkle.lock")["pid"] == os.getpid()
    output_lock.release_all()
