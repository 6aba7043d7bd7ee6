"""``--mode ray`` as a single controller (``twinkle.runtime.controller``): the driver runs the
loop, the model lives on a group of two CPU ranks (FSDP2, gloo), on a local Ray cluster.

The end-to-end runs (``controller_driver.py`` in a subprocess) share one cluster of 2 CPUs
(``ray start --head``) and are marked ``cluster``; the pieces they rely on (the fit check,
slicing and joining per-rank values) are checked in the default run."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from controller_driver import BATCH, STEPS, engine_syncs, lora
from ports import free_port
from shared_data import build_dataset
from tolerances import run_loss_rtol

import twinkle
from twinkle import DeviceGroup, DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.model import TransformersModel
from twinkle.runtime import remote
from twinkle.runtime.controller import check_fit
from twinkle.utils.errors import UserError

DRIVER = Path(__file__).with_name("controller_driver.py")
RAY = str(Path(sys.executable).with_name("ray"))
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
# 4 rows of at most 128 tokens, summed in another order over 2 ranks (see tolerances)
LOSS_RTOL = run_loss_rtol(rows=BATCH, tokens=128, ranks=2)


# ------------------------------------------------------------------ default run: the pieces


def test_groups_that_do_not_fit_are_one_line_naming_what_each_asks():
    with pytest.raises(UserError) as info:
        check_fit({"CPU": 2.0}, [DeviceGroup("model", 2, "CPU"), DeviceGroup("sampler", 1, "CPU")])
    assert str(info.value) == (
        "initialize(groups=...): the groups ask for 3 CPU(s) in all ('model' 2 CPU(s), 'sampler' 1 CPU(s)) "
        "and the cluster has 2; give the groups fewer ranks or add nodes"
    )
    with pytest.raises(UserError, match=r"group\(s\) 'model' ask for GPUs and this cluster has none"):
        check_fit({"CPU": 8.0}, [DeviceGroup("model", 2, "GPU")])
    check_fit({"CPU": 3.0}, [DeviceGroup("model", 2, "CPU"), DeviceGroup("sampler", 1, "CPU")])


def test_a_global_batch_is_sliced_by_data_rank_and_parts_join_back():
    mesh = DeviceMesh(fsdp_size=2, dp_size=1)
    rows = [{"i": i} for i in range(5)]
    assert [remote._slice(rows, mesh, r) for r in (0, 1)] == [rows[:3], rows[3:]]
    batch = {"input_ids": torch.arange(8).reshape(4, 2), "note": "kept"}
    parts = [remote._slice(batch, mesh, r) for r in (0, 1)]
    assert parts[1]["note"] == "kept" and parts[1]["input_ids"].tolist() == [[4, 5], [6, 7]]
    # the ranks' outputs join as one process's would: the loss weighed by its count
    joined = remote.join(
        [
            {"loss": 2.0, "num_tokens": 1, "logps": torch.ones(1, 2)},
            {"loss": 5.0, "num_tokens": 3, "logps": torch.ones(2, 3)},
        ]
    )
    assert joined["loss"] == pytest.approx((2.0 + 15.0) / 4) and joined["num_tokens"] == 4
    assert joined["logps"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    labels = remote.join([{"labels": torch.ones(1, 1)}, {"labels": torch.ones(1, 2)}])["labels"]
    assert labels.tolist() == [[1, -100], [1, 1]]
    assert remote._weighted_mean([(1.0, 2), (4.0, 1)]) == pytest.approx(2.0)


def test_without_a_controller_remote_group_builds_the_local_object():
    loader = DataLoader(dataset=[{"a": 1}] * 4, batch_size=2, remote_group="model")
    assert isinstance(loader, DataLoader) and len(loader) == 2


# ------------------------------------------------------------------ cluster runs

cluster_runs = [pytest.mark.slow, pytest.mark.cluster, needs_ray]


@pytest.fixture(scope="module")
def cluster():
    temp = Path("/tmp") / f"twc-{os.getpid()}"
    port = free_port()
    subprocess.run(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        check=True, capture_output=True, timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},  # a cluster of this test's own, on this machine
    )  # fmt: skip
    yield f"127.0.0.1:{port}"
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
    return {
        **env,
        "TWINKLE_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
    }


def _drive(tiny_model_dir, tmp_path, mode: str, cluster: str, timeout_s: float = 180):
    return subprocess.run(
        [sys.executable, str(DRIVER), str(tiny_model_dir), str(tmp_path / mode), mode, cluster],
        env=_env(tmp_path), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def _result(job) -> dict:
    assert job.returncode == 0, (job.stdout + job.stderr)[-6000:]
    found = json.loads(next(line for line in job.stdout.splitlines() if line.startswith("{")))
    return {**found, "stdout": job.stdout}


def _local_losses(model_dir: Path) -> tuple[list[float], dict]:
    """The same steps in this process, on whole batches; then the last batch evaluated."""
    twinkle.initialize()
    loader = DataLoader(dataset=build_dataset(model_dir, BATCH * STEPS), batch_size=BATCH)
    model = TransformersModel(str(model_dir))
    model.add_adapter_to_model("default", lora())
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for batch in loader:
        losses.append(model.forward_backward(inputs=batch))
        model.clip_grad_and_step()
    evaluated = model.forward_only(inputs=batch)
    return losses, {
        "loss": evaluated["loss"],
        "num_tokens": evaluated["num_tokens"],
        "rows": len(evaluated["logps"]),
    }


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_a_two_rank_model_group_trains_as_one_process(tiny_model_dir, tmp_path, cluster):
    local, evaluated = _local_losses(tiny_model_dir)
    sliced = _result(_drive(tiny_model_dir, tmp_path, "train", cluster))
    on_group = _result(_drive(tiny_model_dir, tmp_path, "loader", cluster))
    print(f"\n[controller] loss diff vs one process: {_relative(sliced['losses'], local):.2e} (driver batches), "
          f"{_relative(on_group['losses'], local):.2e} (loader on the group), tolerance {LOSS_RTOL:.2e}")  # fmt: skip
    assert len(local) == STEPS and sliced["len"] == on_group["len"] == STEPS
    assert _relative(sliced["losses"], local) <= LOSS_RTOL
    assert _relative(on_group["losses"], local) <= LOSS_RTOL
    for run in (sliced, on_group):  # forward_only's per-rank outputs, joined as one process's
        assert run["outputs"]["num_tokens"] == evaluated["num_tokens"] and run["outputs"]["rows"] == BATCH
        assert _relative([run["outputs"]["loss"]], [evaluated["loss"]]) <= LOSS_RTOL
    # get_device_placement() on the driver: the group, its ranks, their processes and devices
    assert "group 'model': ranks [0, 1] on CPU (1 replica(s) x 2 shard(s) = 2 ranks)" in sliced["stdout"]
    assert re.search(r"rank 1: node \S+, pid \d+, device cpu", sliced["stdout"])
    metric = sliced["metric"]
    assert metric["optimizer_steps"] == STEPS and metric["samples"] == BATCH * STEPS
    saved = Path(sliced["saved"])
    assert (saved / ".twinkle-complete").exists() and (saved / "adapter_model.safetensors").exists()
    assert not list((tmp_path / "train").glob("rank_state_rank*"))  # nothing outside the checkpoint
    assert sorted(p.name for p in saved.glob("rank_state_rank*.pt")) == [
        "rank_state_rank0.pt",
        "rank_state_rank1.pt",
    ]


def test_lora_weights_reach_another_group_as_they_are(tiny_model_dir, tmp_path, cluster):
    got = _result(_drive(tiny_model_dir, tmp_path, "sync", cluster))
    assert got["received"] == got["sent"] and len(got["sent"]) > 0


def test_the_checkpoint_engine_syncs_a_sampler_group_as_it_syncs_a_local_sampler(
    tiny_model_dir, tmp_path, cluster
):
    from twinkle.sampler.torch_sampler import TorchSampler

    got = _result(_drive(tiny_model_dir, tmp_path, "engine", cluster))["syncs"]
    twinkle.initialize()
    model = TransformersModel(str(tiny_model_dir))
    model.add_adapter_to_model("default", lora())
    local = engine_syncs(model, TorchSampler(str(tiny_model_dir)))
    assert [s["mode"] for s in got] == ["lora", "merged", "lora"]
    assert got == local and got[2]["bytes"] > got[0]["bytes"] > 0  # the base weights went back first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_killed_rank_ends_the_run_with_one_line_and_no_process_left(tiny_model_dir, tmp_path, cluster):
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(tiny_model_dir), str(tmp_path / "kill"), "kill", cluster],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    pids = json.loads(line)["pids"]
    time.sleep(2)  # a few steps in
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: ray: group 'model' rank 1: the worker process died \(.*\); the run stops", last
    ), err[-4000:]
    assert "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def test_a_group_larger_than_the_cluster_is_one_line_at_once(tiny_model_dir, tmp_path, cluster):
    start = time.monotonic()
    job = _drive(tiny_model_dir, tmp_path, "oversize", cluster, timeout_s=120)
    assert time.monotonic() - start < 60
    assert job.returncode == 1
    assert job.stderr.strip().splitlines()[-1] == (
        "error: initialize(groups=...): the groups ask for 64 CPU(s) in all ('model' 64 CPU(s)) and the "
        "cluster has 2; give the groups fewer ranks or add nodes"
    ), job.stderr[-2000:]


for _test in (
    test_a_two_rank_model_group_trains_as_one_process,
    test_lora_weights_reach_another_group_as_they_are,
    test_the_checkpoint_engine_syncs_a_sampler_group_as_it_syncs_a_local_sampler,
    test_a_killed_rank_ends_the_run_with_one_line_and_no_process_left,
    test_a_group_larger_than_the_cluster_is_one_line_at_once,
):
    for _mark in cluster_runs:
        _mark(_test)
