"""``--mode ray``: the verbatim contract on Ray workers (CPU, gloo), against torchrun.

One Ray cluster (``ray start --head``, 2 CPUs) serves the module's jobs through
``--ray-address``, which saves its start-up in every test; one test lets the job start and stop a
cluster of its own. Ray and torchrun run the same ranks on the same threads; their losses are
compared as in ``test_contract_torchrun.py`` (``LOSS_RTOL``, derived: the same sums, possibly in
another order), and the adapters they end with, also of runs that differ in where a restart
resumed, within ``tolerances.muon_weight_atol`` (the contract's Muon may flip a bf16 rounding of
its Newton-Schulz where a gradient differs in its last bits)."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ports import free_port
from safetensors.torch import load_file
from test_contract_torchrun import LOSS_RTOL, SCRIPT, contract_args, logged_losses, loss_diffs
from tolerances import muon_weight_atol

from twinkle.runtime.ray_logs import END

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (scripts/install.sh installs it)",
    ),
]
RAY = str(Path(sys.executable).with_name("ray"))


def _rank_pids() -> list[int]:
    """Processes running a Ray worker of this package's actor (``ray::Rank...``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith("ray::Rank") or cmdline.startswith("ray::rank"):
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    temp = Path("/tmp") / f"twr-{os.getpid()}"
    port = free_port()
    subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        check=True, capture_output=True, timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},  # a cluster of this test's own, on this machine
    )  # fmt: skip
    yield f"127.0.0.1:{port}"
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def _ray_job(launcher, args: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "ray", *args],
        cwd=SCRIPT.parent,
        env=launcher.env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def _assert_same_adapter(a: Path, b: Path, steps: int = 4) -> None:
    """The adapters two runs of the contract (lr 1e-2, Muon) end with after at most ``steps``
    optimizer steps each, from the same start, differ at most by Muon's bf16 rounding flips."""
    left, right = _adapter(a), _adapter(b)
    assert left.keys() == right.keys()
    tol = muon_weight_atol(1e-2, steps, [t.shape for t in left.values()])
    worst = max(float((left[k] - right[k]).abs().max()) for k in left)
    assert worst <= tol, (worst, tol)


def test_ray_matches_torchrun_and_their_checkpoints_resume_each_other(
    tiny_model_dir, tmp_path, launcher, cluster, baseline
):
    flags = ["--fsdp-size", "2"]
    torchrun, tr = baseline[1], baseline[2] / "two"  # the contract under torchrun, 2 FSDP2 ranks
    ray = _ray_job(
        launcher, [*contract_args(tiny_model_dir, tmp_path / "ray"), *flags, "--ray-address", cluster]
    )
    assert ray.returncode == 0, (ray.stdout + ray.stderr)[-6000:]
    output = ray.stdout + ray.stderr
    assert "1 replica(s) x 2 shard(s) = 2 ranks" in output
    assert "repeated" not in output  # Ray folds repeated lines unless told not to
    assert END not in output  # the ranks' end lines are taken out before Ray prints them

    train_t, eval_t = logged_losses(torchrun.output)
    train_r, eval_r = logged_losses(output)  # each step once: no line twice
    assert sorted(train_t) == sorted(train_r) == [1, 2, 3, 4]
    diffs = loss_diffs(train_t, train_r, eval_t, eval_r)
    print(f"\n[ray] max loss diff against torchrun {max(diffs):.2e} relative")
    assert max(diffs) <= LOSS_RTOL, (train_t, train_r)
    _assert_same_adapter(tr / "last-checkpoint", tmp_path / "ray" / "last-checkpoint")

    # Ray resumes torchrun's checkpoint, torchrun resumes Ray's: each ends where its source did
    resumed = _ray_job(
        launcher,
        [*contract_args(tiny_model_dir, tmp_path / "ray-from-tr"), *flags, "--ray-address", cluster,
         "--resume-from-checkpoint", str(tr / "checkpoint-2")],
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    _assert_same_adapter(tr / "last-checkpoint", tmp_path / "ray-from-tr" / "last-checkpoint")
    back = launcher.run(
        SCRIPT,
        [*contract_args(tiny_model_dir, tmp_path / "tr-from-ray"), *flags,
         "--resume-from-checkpoint", str(tmp_path / "ray" / "checkpoint-2")],
        nproc=2,
    )  # fmt: skip
    assert back.returncode == 0, back.output[-4000:]
    _assert_same_adapter(tmp_path / "ray" / "last-checkpoint", tmp_path / "tr-from-ray" / "last-checkpoint")


LONG = ["--train-samples", "32", "--eval-interval", "2"]  # 8 steps: time to kill one mid-run


def _kill_a_worker_after(folder: Path, done: threading.Event, killed: list) -> None:
    """SIGKILL one worker once ``folder`` is a complete checkpoint."""
    deadline = time.monotonic() + 200
    while not done.is_set() and time.monotonic() < deadline:
        if (folder / ".twinkle-complete").exists():
            pids = _rank_pids()
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
                return
        time.sleep(0.01)


def _run_killing_one(
    launcher, args: list[str], folder: Path
) -> tuple[subprocess.CompletedProcess, list, float]:
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_a_worker_after, args=(folder, done, killed))
    watcher.start()
    start = time.monotonic()
    try:
        job = _ray_job(launcher, args)
    finally:
        done.set()
        watcher.join()
    return job, killed, time.monotonic() - start


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(tiny_model_dir, tmp_path, launcher, cluster):
    base = [*contract_args(tiny_model_dir, tmp_path / "whole"), "--fsdp-size", "2", *LONG]
    whole = launcher.run(SCRIPT, base, nproc=2)
    assert whole.returncode == 0, whole.output[-4000:]
    args = [*contract_args(tiny_model_dir, tmp_path / "killed"), "--fsdp-size", "2", *LONG]
    job, killed, _ = _run_killing_one(
        launcher,
        [*args, "--ray-address", cluster, "--max-restarts", "1"],
        tmp_path / "killed" / "checkpoint-2",
    )
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-6000:]
    assert killed, "no worker was found to kill"
    assert "the worker process died" in output and "restarting the workers (1 restart(s) left)" in output
    assert "--resume-from-checkpoint auto: resuming from" in output
    _assert_same_adapter(tmp_path / "whole" / "last-checkpoint", tmp_path / "killed" / "last-checkpoint", 8)
    assert not _rank_pids()


def test_without_restarts_a_dead_worker_ends_the_job_with_one_line(
    tiny_model_dir, tmp_path, launcher, cluster
):
    args = [
        *contract_args(tiny_model_dir, tmp_path / "out"),
        "--fsdp-size",
        "2",
        *LONG,
        "--ray-address",
        cluster,
    ]
    job, killed, _ = _run_killing_one(launcher, args, tmp_path / "out" / "checkpoint-2")
    assert killed
    assert job.returncode != 0
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(r"error: --mode ray: rank \d the worker process died", errors[0]), (
        errors
    )
    time.sleep(1)
    assert not _rank_pids()


def test_more_workers_than_the_cluster_has_fails_fast_and_leaves_no_process(
    tiny_model_dir, tmp_path, launcher
):
    """No --ray-address: the job starts a local cluster of its own, and stops it."""
    start = time.monotonic()
    job = _ray_job(
        launcher, [*contract_args(tiny_model_dir, tmp_path / "out"), "--fsdp-size", "64"], timeout_s=120
    )
    assert time.monotonic() - start < 60
    assert job.returncode == 1
    assert (
        job.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --mode ray: 64 workers need 64 CPU(s), and the cluster has")
    ), job.stderr[-2000:]
    leftover = subprocess.run(
        ["pgrep", "-f", "twinkle-ray|twinkle-cache/ray"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", leftover.stdout


def test_an_address_that_does_not_answer_is_one_line(tiny_model_dir, tmp_path, launcher):
    start = time.monotonic()
    job = _ray_job(
        launcher,
        [*contract_args(tiny_model_dir, tmp_path / "out"), "--ray-address", f"127.0.0.1:{free_port()}"],
    )
    assert time.monotonic() - start < 60
    assert job.returncode == 1
    assert re.match(
        r"error: --ray-address 127\.0\.0\.1:\d+: no Ray cluster answers there", job.stderr.strip()
    )


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    from twinkle.runtime import ray_job
    from twinkle.utils.errors import UserError

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UserError, match=r"--mode ray needs Ray: pip install 'twinkle\[ray\]'"):
        ray_job._ray()


def test_a_restart_resumes_from_auto_whatever_the_first_launch_resumed_from():
    from twinkle.runtime.ray_job import _restart_argv

    assert _restart_argv(["--lr", "1", "--resume-from-checkpoint", "x", "--resume-from-checkpoint=y"]) == [
        "--lr", "1", "--resume-from-checkpoint", "auto",
    ]  # fmt: skip


def test_a_two_node_cluster_spreads_the_workers(tiny_model_dir, tmp_path, launcher, monkeypatch):
    """Two nodes simulated on this machine (``ray.cluster_utils.Cluster``), one CPU each."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster of this test's own
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        two.add_node(num_cpus=1)
        two.wait_for_nodes()
        job = _ray_job(
            launcher,
            [*contract_args(tiny_model_dir, tmp_path / "out"), "--fsdp-size", "2",
             "--ray-address", two.address, "--ray-placement", "spread"],
        )  # fmt: skip
    finally:
        two.shutdown()
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
    assert "ray: 2 workers on 2 node(s)" in output
    assert (tmp_path / "out" / "last-checkpoint" / ".twinkle-complete").exists()


def test_sigterm_to_the_driver_saves_on_every_worker_and_exits_75(
    tiny_model_dir, tmp_path, launcher, cluster
):
    from twinkle.runtime.preemption import PREEMPTED_EXIT_CODE

    out = tmp_path / "out"
    args = [
        *contract_args(tiny_model_dir, out),
        "--fsdp-size",
        "2",
        "--train-samples",
        "400",
        "--eval-interval",
        "1000",
    ]
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--mode", "ray", *args, "--ray-address", cluster],
            cwd=SCRIPT.parent, env=launcher.env, stdout=handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 200
        while (
            "Current is step 3 " not in log.read_text()
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    text = log.read_text()
    assert code == PREEMPTED_EXIT_CODE, text[-4000:]
    saved = [p for p in out.glob("checkpoint-*") if (p / ".twinkle-complete").exists()]
    assert len(saved) == 1 and sorted(p.name for p in saved[0].glob("rank_state_rank*.pt")) == [
        "rank_state_rank0.pt",
        "rank_state_rank1.pt",
    ]
    time.sleep(1)
    assert not _rank_pids()
