"""SIGTERM (a scheduler preempting the job): a checkpoint at the next step boundary, the
documented exit code, and ``--resume-from-checkpoint auto`` ends where an uninterrupted run does.

In ``tests/run`` because it preempts the real script: signal handling, the save and the resume
together."""

import os
import queue
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import warm
from harness import Beside, run_script, script_command, script_env
from safetensors.torch import load_file

from twinkle.runtime.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

FLAGS = (
    *("--train-samples", "16", "--batch-size", "4", "--eval-samples", "4"),
    *("--eval-interval", "100", "--log-interval", "1", "--lr", "1e-2", "--lora-dropout", "0"),
)
STEP = re.compile(r"Current is step (\d+) of")


def test_sigterm_saves_at_the_next_step_and_auto_resumes_to_the_same_end(tiny_model_dir, tmp_path):
    env = script_env(tmp_path)
    whole = tmp_path / "whole"
    # the uninterrupted run goes on beside the preempted one, in a fresh interpreter (the warm
    # process runs one script at a time, and runs the preempted one)
    argv = script_command(tiny_model_dir, whole, *FLAGS)[1:]
    reference = Beside(warm.run, argv, tmp_path, env, 300, False, True)

    out, log = tmp_path / "preempted", tmp_path / "log.txt"
    try:
        # the preempted run: a process of its own forked from the warm one, its stderr to ``log``
        started = queue.SimpleQueue()
        argv = script_command(tiny_model_dir, out, *FLAGS)[1:]
        preempted = Beside(warm.run, argv, tmp_path, env, 300, False, False, log, started.put)
        pid = started.get(timeout=300)
        deadline = time.monotonic() + 200
        while not STEP.search(log.read_text()) and preempted.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended before a step was logged: its exit code says how
            pass
        code = preempted.result(120).returncode
    finally:
        reference.join(600)
    text = log.read_text()
    done = reference.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert code == PREEMPTED_EXIT_CODE, text[-3000:]
    saved = [p for p in out.glob("checkpoint-*") if (p / ".twinkle-complete").exists()]
    assert len(saved) == 1 and "SIGTERM: saving checkpoint-" in text
    step = int(saved[0].name.split("-")[1])
    assert 1 <= step < 4 and not (out / "last-checkpoint").exists()

    resumed = run_script(tmp_path, tiny_model_dir, out, *FLAGS, "--resume-from-checkpoint", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {saved[0]}" in resumed.stderr
    expected = load_file(Path(whole) / "last-checkpoint" / "adapter_model.safetensors")
    got = load_file(out / "last-checkpoint" / "adapter_model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # one process: bit for bit
