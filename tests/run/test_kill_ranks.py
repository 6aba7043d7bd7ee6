"""SIGKILL one rank of a 2-rank torchrun job, during a training step and then during a save:
the job ends non-zero in bounded time, no torn checkpoint passes for complete, and
``--resume-from-checkpoint auto`` finishes the run with the uninterrupted run's adapter, bit for bit.

The verbatim contract script runs FSDP2 over 2 gloo ranks (``--fsdp-size 2``), 4 steps, an
evaluation and a ``checkpoint-<step>`` save every 2 steps, then ``last-checkpoint``. One job is
killed three times over, each relaunch resuming with ``auto``:

1. during step 4 (rank 0 has logged step 3; ``checkpoint-2`` is complete);
2. during the save of ``checkpoint-4`` (its temporary folder ``.checkpoint-4.tmp`` exists);
3. not at all: it runs to the end.

A step or a save of the tiny model takes milliseconds, too short to hit by polling alone. So once
the log or the output dir shows the moment, the test freezes both ranks (SIGSTOP), checks that
the moment has not passed, SIGKILLs rank 1 and lets rank 0 go on (SIGCONT): to rank 0 that is a
peer dying while it was descheduled. Rank 1's pid is read from ``/proc``: the process of the job's
session whose environment has ``RANK=1``.

"Bit for bit" holds because a resume restores every rank's state (weights, Muon momentum,
scheduler, each rank's RNG and open window) and the data order, and the 2 ranks reduce in the
same order in every job; every loss any attempt logged is also the uninterrupted run's, as text.

In ``tests/run`` because it tests the whole run end to end: torchrun, FSDP2, checkpointing and
resume together."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import SCRIPT, script_env
from ports import free_port
from safetensors.torch import load_file

from twinkle.checkpoint import check_checkpoint, is_complete, latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

FLAGS = (
    *("--train-samples", "16", "--batch-size", "4", "--eval-samples", "8", "--eval-interval", "2"),
    *("--log-interval", "1", "--lora-dropout", "0", "--lr", "1e-2", "--num-warmup-steps", "1"),
    *("--fsdp-size", "2"),
)  # the flags of tests/distributed/test_contract_torchrun.py
STEP_LINE = re.compile(r"Current is step (\d+) of \d+, metric: \{'loss': ([^,}]+)")
RESUMED = re.compile(r"--resume-from-checkpoint auto: (?:resuming from (\S+)|no complete checkpoint)")
KILLED_RANK_1 = re.compile(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9\b")
END_S = 60  # a killed job must be over this long after the kill (torchrun's own grace is 30 s)
RUN_S = 180  # any one job, start to end


def logged_losses(log: str) -> dict[int, str]:
    return {int(step): loss for step, loss in STEP_LINE.findall(log)}


class Job:
    """The contract script under ``torchrun --nproc_per_node 2``, its own session, output to a file."""

    def __init__(self, model_dir: Path, out: Path, log: Path, env: dict[str, str], *extra: str):
        self.log = log
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(SCRIPT), "--model-id", str(model_dir), "--output-dir", str(out), *FLAGS, *extra,
        ]  # fmt: skip
        with open(log, "w") as handle:
            self.proc = subprocess.Popen(
                command,
                cwd=log.parent,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()
        self.workers: dict[int, int] = {}
        self.killed = 0.0  # when rank 1 was killed (time.monotonic)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_pids(self) -> dict[int, int]:
        """Rank -> pid of the job's workers: torchrun's children with ``RANK`` in their environment
        (each in a session of its own, so the job's session does not find them)."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if _parent(int(entry)) != self.proc.pid:
                    continue
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
            if ranks and any(v.startswith(b"TORCHELASTIC_RUN_ID=") for v in environ):
                found[int(ranks[0])] = int(entry)
        self.workers.update(found)
        return found

    def wait_for(self, moment) -> None:  # noqa: ANN001
        """Poll until ``moment(self)`` is true while the job runs; fail the test if it never is."""
        while not moment(self):
            if self.proc.poll() is not None or time.monotonic() - self.started > RUN_S:
                self.end()
                pytest.fail(
                    f"the moment to kill never came (exit {self.proc.returncode}):\n{self.text()[-4000:]}"
                )
            time.sleep(0.001)

    def kill_rank_1_if(self, still_in_moment) -> None:  # noqa: ANN001
        """Freeze both ranks, check that ``still_in_moment(self)`` holds, SIGKILL rank 1, resume rank 0."""
        pids = self.rank_pids()
        assert sorted(pids) == [0, 1], pids
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            assert still_in_moment(self), "the moment passed before both ranks were stopped"
            os.kill(pids[1], signal.SIGKILL)
            self.killed = time.monotonic()
        finally:
            os.kill(pids[0], signal.SIGCONT)

    def end(self, timeout: float = RUN_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def assert_no_worker_left(self) -> None:
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in self.workers.values()):
            assert time.monotonic() < deadline, f"workers {self.workers} outlived the job"
            time.sleep(0.1)


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _running(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def assert_nothing_torn_passes(out: Path) -> None:
    """Every visible folder with checkpoint files is either complete and intact, or has no marker
    (and then ``auto`` never picks it); the one ``auto`` picks is complete and intact."""
    for folder in out.iterdir():
        if folder.is_dir() and not folder.name.startswith("."):
            if is_complete(folder):
                report = check_checkpoint(folder)
                assert report.ok and report.verified, (folder, report.describe())
    chosen = latest_checkpoint(out)
    assert chosen is None or (is_complete(chosen) and check_checkpoint(chosen).ok)


def test_killing_one_rank_in_a_step_and_in_a_save_then_resuming_equals_an_uninterrupted_run(
    tiny_model_dir, tmp_path
):
    env = {**script_env(tmp_path), "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("TWINKLE_") or k == "TWINKLE_CACHE"}

    reference = Job(tiny_model_dir, tmp_path / "reference", tmp_path / "reference.log", env)
    assert reference.end() == 0, reference.text()[-4000:]
    expected_losses = logged_losses(reference.text())
    assert sorted(expected_losses) == [1, 2, 3, 4]
    expected = load_file(tmp_path / "reference" / "last-checkpoint" / "adapter_model.safetensors")

    out = tmp_path / "out"
    ckpt2, ckpt4 = out / "checkpoint-2", out / "checkpoint-4"
    saving4 = out / ".checkpoint-4.tmp"

    def step_3_logged(job: Job) -> bool:
        return 3 in logged_losses(job.text())

    def in_step_4(job: Job) -> bool:  # step 3 is over, step 4 not yet, nor its save
        return 4 not in logged_losses(job.text()) and not saving4.exists() and not ckpt4.exists()

    def save_4_began(job: Job) -> bool:
        return saving4.exists()

    def in_save_4(job: Job) -> bool:  # its temporary folder exists, the finished one does not yet
        return saving4.exists() and not ckpt4.exists()

    plans = [("step", step_3_logged, in_step_4), ("save", save_4_began, in_save_4), (None, None, None)]
    resumed_from = []
    for attempt, (plan, moment, still) in enumerate(plans, 1):
        chosen = latest_checkpoint(out) if out.exists() else None
        job = Job(
            tiny_model_dir, out, tmp_path / f"attempt-{attempt}.log", env, "--resume-from-checkpoint", "auto"
        )
        if plan is not None:
            job.wait_for(moment)
            job.kill_rank_1_if(still)
            code = job.end(timeout=END_S)
            took = time.monotonic() - job.killed
            print(f"\n[kill rank 1 in a {plan}] job exit {code} {took:.1f} s after the kill")
            text = job.text()
            assert code != 0, text[-4000:]
            assert took < END_S, took
            assert KILLED_RANK_1.search(text), text[-4000:]  # torchrun's summary names the dead rank
            # the survivor says in one line what happened instead of gloo's traceback
            assert "error: another rank of this job stopped during a collective" in text, text[-4000:]
            assert "[rank0]: Traceback" not in text  # (torchrun's own failure report follows)
            job.assert_no_worker_left()
            assert_nothing_torn_passes(out)
            # rank 0 outlives rank 1 long enough to remove the temporary folder of the save it was in
            assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")], sorted(os.listdir(out))
        else:
            code = job.end()
            assert code == 0, job.text()[-4000:]
        text = job.text()
        found = RESUMED.search(text)
        assert found, text[-4000:]
        resumed_from.append(found.group(1) and Path(found.group(1)))
        assert resumed_from[-1] == chosen, (resumed_from, chosen)
        for step, loss in logged_losses(text).items():
            assert loss == expected_losses[step], (plan, step, loss, expected_losses[step])

    assert resumed_from[0] is None and resumed_from[1] == ckpt2, resumed_from
    assert resumed_from[2] in (ckpt2, ckpt4), resumed_from
    actual = load_file(out / "last-checkpoint" / "adapter_model.safetensors")
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
