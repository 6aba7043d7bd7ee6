"""Upstream Twinkle's local-path names: ``Platform``, ``DeviceGroup`` and ``DeviceMesh``'s
upstream form, on this machine (the CPU checks skip where an accelerator is present)."""

import dataclasses

import numpy as np
import pytest
import torch

import twinkle
from twinkle import DeviceGroup, DeviceMesh, Platform
from twinkle.utils.errors import UserError
from twinkle.utils.platform import CPU, GPU, MPS, NPU

_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "NNODES",
    "NODE_RANK",
    "GROUP_RANK",
)
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available() or Platform.is_npu_available(), reason="checks a machine without an accelerator"
)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    """Start every test as a process no launcher started."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def test_exported_from_the_package():
    assert {"Platform", "DeviceGroup", "DeviceMesh"} <= set(twinkle.__all__)
    assert twinkle.Platform is Platform and twinkle.DeviceGroup is DeviceGroup
    assert twinkle.distributed.DeviceGroup is DeviceGroup


# ---------------------------------------------------------------- Platform


@cpu_only
def test_platform_on_a_cpu_machine():
    assert Platform.get_platform() is CPU
    assert Platform.device_prefix() == "cpu"
    assert Platform.get_platform().device_prefix() == "cpu"
    assert Platform.device_backend() == "gloo"
    assert Platform.device_count() == 1
    assert Platform.get_local_device() == "cpu"
    assert Platform.visible_device_env() is None
    assert Platform.get_device_rng_state() is None
    assert not Platform.is_gpu_available()


def test_platform_agrees_with_the_runtime():
    # the runtime picks cuda > npu > cpu, and the process group backend from the device
    assert Platform.device_prefix() == twinkle.utils.framework.Torch.device_type()
    runtime_backend = {"cuda": "nccl", "npu": "hccl"}.get(Platform.device_prefix(), "gloo")
    assert Platform.device_backend() == runtime_backend


@pytest.mark.parametrize(
    ("name", "cls", "prefix", "backend", "env"),
    [
        ("GPU", GPU, "cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
        ("cuda", GPU, "cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
        ("npu", NPU, "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
        ("MPS", MPS, "mps", "gloo", None),
        ("Cpu", CPU, "cpu", "gloo", None),
    ],
)
def test_platform_by_name(name, cls, prefix, backend, env):
    assert Platform.get_platform(name) is cls
    assert Platform.device_prefix(name) == cls.device_prefix() == prefix
    assert Platform.device_backend(name) == cls.device_backend() == backend
    assert Platform.visible_device_env(name) == env


def test_a_named_platform_answers_for_itself():
    # called on the class get_platform returns, not the auto-detected one
    assert GPU.get_local_device(3) == "cuda:3"
    assert NPU.get_local_device(1) == "npu:1"
    assert MPS.get_local_device(2) == "mps"
    assert Platform.get_local_device(0, platform="GPU") == "cuda:0"
    assert Platform.get_platform_names() == ["GPU", "NPU", "MPS", "CPU"]


@cpu_only
def test_absent_accelerators_count_zero_and_keep_no_rng_state():
    assert GPU.device_count() == 0 and NPU.device_count() == 0
    assert GPU.get_device_rng_state() is None
    GPU.set_device_rng_state(torch.zeros(8, dtype=torch.uint8))  # nothing to restore into: a no-op


def test_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert Platform.visible_devices("GPU") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert GPU.visible_devices() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert GPU.visible_devices() == []
    assert CPU.visible_devices() is None


def test_unknown_and_unsupported_platforms():
    with pytest.raises(UserError, match="not supported yet: XPU"):
        Platform.get_platform("xpu")
    with pytest.raises(UserError, match="unknown platform 'tpu'"):
        Platform.get_platform("tpu")
    with pytest.raises(UserError, match="not supported yet: get_vllm_device_uuid"):
        Platform.get_vllm_device_uuid()


def test_ranks_without_a_launcher():
    assert (Platform.get_rank(), Platform.get_local_rank()) == (-1, -1)
    assert (Platform.get_world_size(), Platform.get_local_world_size()) == (1, 1)
    assert (Platform.get_nnodes(), Platform.get_node_rank()) == (1, 0)
    assert Platform.is_master() and Platform.is_local_master() and Platform.is_last_rank()


def test_ranks_under_torchrun(monkeypatch):
    # rank 5 of 8 over 2 nodes of 4: torchrun sets GROUP_RANK, not NODE_RANK or NNODES
    for name, value in dict(RANK=5, LOCAL_RANK=1, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, GROUP_RANK=1).items():
        monkeypatch.setenv(name, str(value))
    assert (Platform.get_rank(), Platform.get_local_rank(), Platform.get_world_size()) == (5, 1, 8)
    assert (Platform.get_local_world_size(), Platform.get_nnodes(), Platform.get_node_rank()) == (4, 2, 1)
    assert not Platform.is_master() and not Platform.is_local_master() and not Platform.is_last_rank()
    monkeypatch.setenv("RANK", "7")
    assert Platform.is_last_rank()
    monkeypatch.setenv("NNODES", "3")
    assert Platform.get_nnodes() == 3


def test_a_malformed_rank_variable_is_a_user_error(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(UserError, match=r"\$RANK must be an integer, got 'zero'"):
        Platform.get_rank()


@pytest.mark.parametrize(
    ("target", "world", "expected"),
    [
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),  # the first 10 % 4 ranks take one more
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 4, [(0, 1), (1, 2), (0, 1), (1, 2)]),  # fewer items than ranks: round robin
    ],
)
def test_get_peer_index(target, world, expected):
    got = [Platform.get_peer_index(target, rank=r, world_size=world) for r in range(world)]
    assert [(s.start, s.stop) for s in got] == expected


def test_get_peer_index_reads_the_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert Platform.get_peer_index(9) == slice(6, 9)


# ---------------------------------------------------------------- DeviceGroup


def test_device_group_normalises_ranks_and_device_type():
    group = DeviceGroup(name="model", ranks=[0, 1, 2, 3], device_type="GPU")
    assert group.ranks == (0, 1, 2, 3) and group.device_type == "cuda" and group.gpus_per_worker == 1
    assert DeviceGroup(name="model", ranks=4, device_type="cuda") == group  # a count: ranks 0..3
    assert DeviceGroup(name="s", ranks=np.array([4, 6]), device_type="npu").ranks == (4, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        group.ranks = (0,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ranks=[0, 1, 1, 2, 2]), r"ranks must be unique, got \[1, 2\] more than once"),
        (dict(ranks=[0, -1]), r"ranks must be non-negative, got \[-1\]"),
        (dict(ranks=[]), "ranks must hold at least one rank, got none"),
        (dict(ranks=0), "ranks must hold at least one rank, got the count 0"),
        (dict(ranks=[0, 1.5]), "each rank must be an integer, got 1.5"),
        (dict(ranks="0,1"), "ranks must be a count or a list of ranks"),
        (dict(device_type="tpu"), "device_type: unknown platform 'tpu'"),
        (dict(device_type="xpu"), "device_type: .*not supported yet: XPU"),
        (dict(device_type=None), "device_type must be a name"),
        (dict(gpus_per_worker=0), "gpus_per_worker must be at least 1, got 0"),
        (dict(gpus_per_worker=2), "not supported yet: gpus_per_worker"),
        (dict(name=""), "name must be a non-empty string"),
    ],
)
def test_device_group_validation(kwargs, message):
    args = dict(name="model", ranks=[0, 1], device_type="cuda") | kwargs
    with pytest.raises(UserError, match=message) as info:
        DeviceGroup(**args)
    assert "\n" not in str(info.value)
    if args["name"]:
        assert str(info.value).startswith("DeviceGroup 'model': ")


# ---------------------------------------------------------------- DeviceMesh: upstream's form


@pytest.mark.parametrize(
    ("mesh", "names", "fsdp", "dp"),
    [
        (np.array([[0, 1], [2, 3]]), ("dp", "fsdp"), 2, 2),
        (np.arange(6).reshape(2, 3), ("dp", "fsdp"), 3, 2),
        (np.arange(6).reshape(2, 3).T, ("fsdp", "dp"), 3, 2),  # same ranks, dimensions swapped
        (np.arange(4), ("dp",), 1, 4),
        ([0, 1, 2, 3], ("fsdp",), 4, 1),
        (torch.arange(4).reshape(2, 1, 2), ("dp", "tp", "fsdp"), 2, 2),  # an unused dimension of 1
    ],
)
def test_upstream_form_equals_the_sizes_form(mesh, names, fsdp, dp):
    built = DeviceMesh(device_type="cuda", mesh=mesh, mesh_dim_names=names)
    assert (
        built == DeviceMesh(fsdp_size=fsdp, dp_size=dp) == DeviceMesh.from_sizes(fsdp_size=fsdp, dp_size=dp)
    )
    assert hash(built) == hash(DeviceMesh(fsdp_size=fsdp, dp_size=dp))
    assert built.device_type == "cuda" and built.world_size == fsdp * dp


def test_the_mesh_reads_back_in_upstream_terms():
    mesh = DeviceMesh(fsdp_size=3, dp_size=2, device_type="GPU")
    assert mesh.device_type == "cuda"  # a platform name stands for its device type
    assert mesh.mesh.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert mesh.mesh_dim_names == ("dp", "fsdp")
    assert (mesh.dp_world_size, mesh.fsdp_world_size) == (2, 3)
    assert (mesh.get_dim_size("dp"), mesh.get_dim_size("fsdp")) == (2, 3)
    assert mesh.has_dim("fsdp") and not mesh.has_dim("tp")
    with pytest.raises(UserError, match="no dimension 'tp'"):
        mesh.get_dim_size("tp")
    # the round trip: the mesh's own ranks build the same mesh
    assert DeviceMesh(mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names) == mesh


def test_existing_forms_still_work():
    assert DeviceMesh(2, 3) == DeviceMesh(fsdp_size=2, dp_size=3)
    assert dataclasses.replace(DeviceMesh(fsdp_size=2, dp_size=3), dp_size=1) == DeviceMesh(
        fsdp_size=2, dp_size=1
    )
    assert DeviceMesh.from_sizes(dp_size=2, world_size=6) == DeviceMesh(fsdp_size=3, dp_size=2)
    assert DeviceMesh.from_sizes() == DeviceMesh(fsdp_size=1, dp_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DeviceMesh(fsdp_size=1, dp_size=1).dp_size = 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("fsdp", "dp")),
            "rank layout is not supported yet",
        ),
        (dict(mesh=[0, 1, 1], mesh_dim_names=("dp",)), r"each of the ranks 0\.\.2 once"),
        (dict(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp",)), "names 1 dimension"),
        (dict(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "row")), "unknown mesh dimension 'row'"),
        (dict(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "dp")), "repeats a name"),
        (dict(mesh=np.arange(4)), "mesh= needs mesh_dim_names="),
        (dict(mesh=[0.0, 1.0], mesh_dim_names=("dp",)), "integer ranks"),
        (dict(mesh=[0, 1], mesh_dim_names=("dp",), fsdp_size=2), "not both"),
        (dict(fsdp_size=2), "needs fsdp_size and dp_size"),
        (dict(fsdp_size=0, dp_size=1), "fsdp_size must be at least 1, got 0"),
        (dict(fsdp_size=1, dp_size=1, device_type="tpu"), "device_type: unknown platform 'tpu'"),
    ],
)
def test_upstream_form_errors(kwargs, message):
    with pytest.raises(UserError, match=message) as info:
        DeviceMesh(**kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- DeviceMesh: data ranks


def test_data_ranks_of_a_2x2_mesh():
    mesh = DeviceMesh(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "fsdp"))
    assert mesh.data_world_size == 4
    # replica-major: rank 2 is replica 1, shard 0, and reads data stream 1 * 2 + 0
    assert [mesh.get_data_rank_from_global_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert [mesh.coordinates(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [mesh.get_slice(10, r) for r in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]
    with pytest.raises(UserError, match="rank 4 is not in this mesh of 4 rank"):
        mesh.get_data_rank_from_global_rank(4)
    with pytest.raises(UserError, match=r"data rank 4 is not in 0\.\.3"):
        mesh.get_slice(10, 4)


def test_data_rank_of_this_process(monkeypatch):
    mesh = DeviceMesh(fsdp_size=2, dp_size=2)
    assert (mesh.data_rank, mesh.dp_rank, mesh.fsdp_rank) == (0, None, None)  # no launcher
    assert mesh.get_slice(8) == slice(0, 2)
    assert DeviceMesh(fsdp_size=1, dp_size=1).is_single_process
    monkeypatch.setenv("RANK", "3")
    assert (mesh.data_rank, mesh.dp_rank, mesh.fsdp_rank) == (3, 1, 1)
    assert mesh.get_slice(8) == slice(6, 8)
    assert not DeviceMesh(fsdp_size=1, dp_size=1).is_single_process


# ---------------------------------------------------------------- DeviceMesh: other dimensions
# (their coordinates, and the model's refusal to run them: test_mesh_dims.py)


@pytest.mark.parametrize(
    "name", ["tp_size", "pp_size", "cp_size", "ep_size", "etp_size", "vpp_size", "ulysses_size"]
)
def test_other_parallel_sizes_are_planned_not_refused(name):
    planned = DeviceMesh.from_sizes(fsdp_size=2, dp_size=1, **{name: 2})
    assert planned.unimplemented() == [f"{name}=2"]
    # 1 or None is no parallelism at all
    assert DeviceMesh.from_sizes(fsdp_size=2, dp_size=1, **{name: 1}) == DeviceMesh(fsdp_size=2, dp_size=1)
    assert DeviceMesh.from_sizes(fsdp_size=2, dp_size=1, **{name: None}) == DeviceMesh(fsdp_size=2, dp_size=1)


def test_other_sizes_are_checked():
    assert DeviceMesh.from_sizes(tp_size=2, sequence_parallel=True).unimplemented() == [
        "tp_size=2",
        "sequence_parallel=True",
    ]
    with pytest.raises(UserError, match="ulysses_size=3 does not divide the 4 data ranks"):
        DeviceMesh(mesh=np.arange(4), mesh_dim_names=("dp",), ulysses_size=3)
    with pytest.raises(UserError, match="tp_size must be at least 1, got 0"):
        DeviceMesh.from_sizes(tp_size=0)
    with pytest.raises(UserError, match="give expert parallelism as ep_size="):
        DeviceMesh(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "ep"))
    assert DeviceMesh(fsdp_size=2, dp_size=1, ulysses_size=1, ep_size=None) == DeviceMesh(2, 1)
