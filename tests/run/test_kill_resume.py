"""SIGKILL the contract script at random points, resume with ``auto``: the result is the same.

One process on CPU, so "the same" means bitwise: the final adapter is ``torch.equal`` to an
uninterrupted run's, and every loss any attempt logged equals the uninterrupted run's loss of that
step. Kill points come from a seeded RNG and from watching the run (its log and its output dir),
not from a hook inside the framework: during a save (a ``.<name>.tmp`` folder exists), during a
training step, and during an evaluation. Where exactly a kill lands still depends on timing; the
assertions hold wherever it lands.

In ``tests/run`` because it tests the whole run end to end: training, evaluation, saves and
resume together."""

import json
import os
import queue
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import warm
from harness import Beside, script_command, script_env
from safetensors.torch import load_file

from twinkle.checkpoint import is_complete, latest_checkpoint

FLAGS = (
    *("--train-samples", "24", "--batch-size", "4", "--eval-samples", "4"),
    *("--eval-interval", "2", "--log-interval", "1", "--lr", "1e-2"),
)
STEPS = 6
STEP_LINE = re.compile(r"Current is step (\d+) of \d+, metric: \{'loss': ([^,}]+)")
RESUMED = re.compile(r"--resume-from-checkpoint auto: (?:resuming from (\S+)|no complete checkpoint)")
SEED = 1234


def logged_losses(log: str) -> dict[int, str]:
    return {int(step): loss for step, loss in STEP_LINE.findall(log)}


def _saving(out: Path) -> bool:
    try:
        return any(name.startswith(".") and name.endswith(".tmp") for name in os.listdir(out))
    except FileNotFoundError:
        return False


def _steps_seen(log: Path) -> list[int]:
    return [int(step) for step, _ in STEP_LINE.findall(log.read_text(errors="replace"))]


def run_until(trigger, command, env, cwd: Path, log: Path, rng: random.Random, max_delay_s: float):
    """Run ``command`` (the script in a process of its own, forked from the warm one, its stderr
    to ``log``); once ``trigger()`` is true wait a random moment, then SIGKILL it.
    Returns (return code, log text); -9 means it was killed."""
    started = queue.SimpleQueue()
    job = Beside(warm.run, command[1:], cwd, env, 300, False, False, log, started.put)
    try:
        pid = started.get(timeout=300)
        while job.is_alive():
            if trigger is not None and trigger():
                time.sleep(rng.uniform(0, max_delay_s))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended just now
                    pass
                break
            time.sleep(0.002)
    finally:
        done = job.result()
    return done.returncode, log.read_text(errors="replace")


def resumed_step(checkpoint: Path | None) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["cur_step"] if checkpoint else 0


def kill_trigger(plan: str | None, out: Path, log: Path, start: int, rng: random.Random):
    """(condition to kill at, longest random delay after it) for one attempt."""
    if plan == "save":  # the moment a checkpoint is being written
        return (lambda: _saving(out)), 0.0
    if plan == "step" and start + 1 < STEPS:  # a random moment inside a later training step
        target = rng.randint(start + 1, STEPS - 1)
        return (lambda: target in _steps_seen(log)), 0.05
    if plan == "eval":  # evaluation starts right after an even step is logged
        return (lambda: any(s % 2 == 0 and s > start for s in _steps_seen(log))), 0.03
    return None, 0.0


def plant_torn_checkpoint(source: Path, out: Path) -> Path:
    """A folder that claims the most steps but has no completion marker: never to be resumed."""
    torn = out / "checkpoint-99"
    shutil.copytree(source, torn)
    (torn / ".twinkle-complete").unlink()
    state = (torn / "trainer_state.json").read_text()
    (torn / "trainer_state.json").write_text(re.sub(r'"cur_step": \d+', '"cur_step": 99', state))
    return torn


@pytest.mark.slow
def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    # the uninterrupted run goes on beside the interrupted ones (a fresh interpreter: the warm
    # process runs one script at a time, and runs theirs); their losses are compared after
    argv = script_command(tiny_model_dir, tmp_path / "reference", *FLAGS)[1:]
    reference = Beside(warm.run, argv, tmp_path, script_env(tmp_path), 300, False, True)
    logged = []  # (plan, step, loss) of every attempt

    try:
        out, rng = tmp_path / "out", random.Random(SEED)
        env = script_env(tmp_path)
        command = script_command(tiny_model_dir, out, *FLAGS, "--resume-from-checkpoint", "auto")
        plans = ["save", "step", "eval"]
        kills, attempts, planted = [], 0, None
        while True:
            attempts += 1
            assert attempts <= 8, f"the run never finished; killed at {kills}"
            chosen = latest_checkpoint(out)
            assert chosen is None or is_complete(chosen)
            log = tmp_path / f"attempt-{attempts}.log"
            plan = plans.pop(0) if plans else None
            trigger, delay = kill_trigger(plan, out, log, resumed_step(chosen), rng)
            code, text = run_until(trigger, command, env, tmp_path, log, rng, delay)
            resumed = RESUMED.search(text)
            assert resumed, text[-3000:]
            assert (resumed.group(1) and Path(resumed.group(1))) == chosen, "resumed from another folder"
            logged += [(plan, step, loss) for step, loss in logged_losses(text).items()]
            if code == -signal.SIGKILL:
                kills.append((plan, _steps_seen(log)[-1:], "mid-save" if _saving(out) else ""))
            else:
                assert code == 0, text[-3000:]
                if plan is None:
                    break
            if planted is None and latest_checkpoint(out) is not None:
                planted = plant_torn_checkpoint(latest_checkpoint(out), out)
    finally:
        reference.join(600)

    reference = reference.result()
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected_losses = logged_losses(reference.stderr)
    assert sorted(expected_losses) == list(range(1, STEPS + 1))
    for plan, step, loss in logged:
        assert loss == expected_losses[step], (plan, step, loss, expected_losses[step])
    expected = load_file(tmp_path / "reference" / "last-checkpoint" / "adapter_model.safetensors")

    assert len(kills) >= 2, kills  # the run really was interrupted (more than once)
    assert planted is not None and not is_complete(planted)
    actual = load_file(out / "last-checkpoint" / "adapter_model.safetensors")
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
