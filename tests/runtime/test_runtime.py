"""Tests for twinkle.runtime and DeviceMesh: size inference, initialize() checks, seeding."""

import random
import re

import numpy as np
import pytest
import torch

import twinkle
from twinkle import DeviceMesh
from twinkle.runtime import runtime
from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """One plain process, and the module's runtime restored after each test."""
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "_RUNTIME", runtime._RUNTIME)


# ---------------------------------------------------------------- DeviceMesh.from_sizes


@pytest.mark.parametrize(
    ("fsdp", "dp", "world", "expected"),
    [
        (None, None, 4, (4, 1)),  # nothing given: shard over every process
        (None, 2, 4, (2, 2)),
        (2, None, 4, (2, 2)),
        (2, 2, 4, (2, 2)),
        (None, None, 1, (1, 1)),
    ],
)
def test_from_sizes_infers_missing_sizes(fsdp, dp, world, expected):
    mesh = DeviceMesh.from_sizes(fsdp_size=fsdp, dp_size=dp, world_size=world)
    assert (mesh.fsdp_size, mesh.dp_size) == expected
    assert mesh.world_size == world


def test_from_sizes_reads_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert DeviceMesh.from_sizes(dp_size=2) == DeviceMesh(fsdp_size=3, dp_size=2)


@pytest.mark.parametrize(
    ("fsdp", "dp", "world", "needs"),
    [(3, None, 4, r"--fsdp-size 3"), (None, 3, 4, r"--dp-size 3"), (2, 2, 2, r"--nproc_per_node 4")],
)
def test_from_sizes_mismatch_names_sizes_and_torchrun(fsdp, dp, world, needs):
    with pytest.raises(UserError, match="torchrun") as info:
        DeviceMesh.from_sizes(fsdp_size=fsdp, dp_size=dp, world_size=world)
    assert f"{world} process(es)" in str(info.value)
    assert re.search(needs, str(info.value))


@pytest.mark.parametrize(("fsdp", "dp", "flag"), [(0, None, "--fsdp-size"), (None, 0, "--dp-size")])
def test_from_sizes_rejects_zero(fsdp, dp, flag):
    with pytest.raises(UserError, match=f"{flag} must be at least 1, got 0"):
        DeviceMesh.from_sizes(fsdp_size=fsdp, dp_size=dp, world_size=2)


def test_mesh_coordinates_are_replica_major():
    mesh = DeviceMesh(fsdp_size=2, dp_size=3)
    assert [mesh.coordinates(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


# ---------------------------------------------------------------- initialize


def test_ray_mode_in_the_driver_runs_the_job_and_exits_with_its_code(monkeypatch):
    from twinkle.runtime import ray_job

    jobs = []
    monkeypatch.setattr(ray_job, "run_job", lambda mesh, defaults: jobs.append(mesh) or 3)
    with pytest.raises(SystemExit) as info:
        twinkle.initialize(mode="ray", global_device_mesh=DeviceMesh(fsdp_size=2, dp_size=1))
    assert info.value.code == 3 and jobs == [DeviceMesh(fsdp_size=2, dp_size=1)]


def test_ray_mode_in_a_worker_is_the_local_path(monkeypatch):
    monkeypatch.setenv("TWINKLE_RAY_WORKER", "1")
    rt = twinkle.initialize(mode="ray", seed=0)
    assert (rt.mode, rt.world_size, rt.rank) == ("ray", 1, 0)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(UserError, match=r"'cluster' is not one of local, ray"):
        twinkle.initialize(mode="cluster")


def test_mesh_larger_than_the_job_is_an_error():
    with pytest.raises(UserError, match=r"2 rank\(s\).* 1 process\(es\).*torchrun --nproc_per_node 2"):
        twinkle.initialize(global_device_mesh=DeviceMesh(fsdp_size=2, dp_size=1), seed=0)


def test_initialize_single_process():
    rt = twinkle.initialize(seed=5)
    assert (rt.mode, rt.rank, rt.world_size, rt.seed) == ("local", 0, 1, 5)
    assert not rt.is_distributed and rt.is_main
    assert runtime.get_runtime() is rt


def test_device_placement_mentions_world_size_and_rank(monkeypatch):
    twinkle.initialize(seed=0)
    text = twinkle.get_device_placement()
    assert "world_size=1" in text and "rank 0" in text

    # A rank of a 2 x 2 job, without starting one: replicas are rows of fsdp shards.
    mesh = DeviceMesh(fsdp_size=2, dp_size=2)
    rt = runtime.Runtime("local", mesh, rank=3, local_rank=1, device=torch.device("cpu"), seed=0)
    monkeypatch.setattr(runtime, "_RUNTIME", rt)
    text = twinkle.get_device_placement()
    assert "world_size=4" in text and "rank 3 (local 1)" in text
    assert "replica 0: fsdp shards on ranks [0, 1]" in text
    assert "replica 1: fsdp shards on ranks [2, 3]" in text


def test_same_seed_gives_same_random_numbers():
    def draw():
        return torch.rand(4), random.random(), np.random.rand()

    twinkle.initialize(seed=123)
    first = draw()
    twinkle.initialize(seed=123)
    second = draw()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    twinkle.initialize(seed=124)
    assert not torch.equal(draw()[0], first[0])


def test_torch_is_gpu_available_is_a_bool():
    assert isinstance(Torch.is_gpu_available(), bool)
    assert Torch.device_type() in ("cuda", "npu", "cpu")
