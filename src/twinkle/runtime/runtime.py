"""``Runtime``: mode, mesh, rank and device of this process, created once by ``initialize``."""

import atexit
import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from twinkle.distributed.fsdp import release_process_groups
from twinkle.distributed.mesh import DeviceMesh
from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch

MODES = ("local", "ray")
DEFAULT_SEED = 42


@dataclass
class Runtime:
    mode: str
    mesh: DeviceMesh
    rank: int
    local_rank: int
    device: torch.device
    seed: int

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_RUNTIME: Runtime | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _default_seed() -> int:
    from twinkle.cli import last_args

    args = last_args()
    return args.infra.seed if args is not None else DEFAULT_SEED


def _pick_device(local_rank: int) -> torch.device:
    kind = Torch.device_type()
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, local_rank)
    getattr(torch, kind).set_device(device)
    return device


def initialize(
    mode: str = "local",
    global_device_mesh: DeviceMesh | None = None,
    seed: int | None = None,
    timeout_s: int | None = None,
) -> Runtime:
    """Set up this process: seed, device (cuda > npu > cpu) and, under torchrun, the process group.

    ``seed`` defaults to the ``--seed`` of the last parsed command line, else 42. Every rank
    uses the same seed so that LoRA weights start identical on all ranks. ``timeout_s`` bounds
    how long a collective waits for a dead peer (default ``--process-group-timeout``, 600 s)."""
    global _RUNTIME
    if mode not in MODES:
        raise UserError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "ray":
        raise UserError(
            "--mode ray is not supported yet; use --mode local (with torchrun for several processes)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = global_device_mesh or DeviceMesh.from_sizes(world_size=world)
    if mesh.world_size != world:
        raise UserError(
            f"the device mesh has {mesh.world_size} rank(s) ({mesh.describe()}) but this job has {world} "
            f"process(es); launch with torchrun --nproc_per_node {mesh.world_size} or change --fsdp-size/--dp-size"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(local_rank)
    if world > 1 and not dist.is_initialized():
        if timeout_s is None:
            from twinkle.cli import last_args

            args = last_args()
            timeout_s = args.infra.process_group_timeout if args is not None else 600
        backend = {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(shutdown)
    seed = _default_seed() if seed is None else seed
    seed_everything(seed)
    _RUNTIME = Runtime(mode=mode, mesh=mesh, rank=rank, local_rank=local_rank, device=device, seed=seed)
    return _RUNTIME


def get_runtime() -> Runtime:
    """The runtime of this process; a single-process CPU/GPU runtime if ``initialize`` was not called."""
    if _RUNTIME is None:
        return initialize()
    return _RUNTIME


def shutdown() -> None:
    """Destroy the process groups, if any, and stop their backends' threads. Safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        release_process_groups()


def get_device_placement() -> str:
    """A readable picture of the mesh: which rank sits where, on which device."""
    rt = get_runtime()
    mesh = rt.mesh
    lines = [f"mode={rt.mode} world_size={rt.world_size} device={rt.device.type} mesh: {mesh.describe()}"]
    for replica in range(mesh.dp_size):
        ranks = [replica * mesh.fsdp_size + shard for shard in range(mesh.fsdp_size)]
        lines.append(f"  replica {replica}: fsdp shards on ranks {ranks}")
    lines.append(f"  this process: rank {rt.rank} (local {rt.local_rank}) on {rt.device}")
    return "\n".join(lines)
