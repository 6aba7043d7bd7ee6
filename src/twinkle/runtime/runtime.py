"""``Runtime``: mode, mesh, rank and device of this process, created once by ``initialize``; and
``RunDefaults``: what a run uses where a call leaves a value out (seed, process-group timeout,
dtype, activation checkpointing).

The CLI hands the parsed command line's values over with ``set_run_defaults`` (so a script need
not pass ``args`` to ``initialize`` or ``TransformersModel``); without a CLI they are the
dataclass's defaults. An explicit argument always wins."""

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
from twinkle.runtime import output_lock, preemption
from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch

MODES = ("local", "ray")
RAY_WORKER = "TWINKLE_RAY_WORKER"  # set in the processes a Ray job's driver starts
DEFAULT_SEED = 42


@dataclass(frozen=True)
class RunDefaults:
    seed: int = DEFAULT_SEED
    process_group_timeout_s: int = 600  # how long a collective waits for a dead peer
    dtype: str = "auto"  # the weights' dtype: auto (bf16 on accelerators, fp32 on CPU), float32, bfloat16
    activation_checkpointing: str = "auto"  # auto, on, off
    strategy: str = "fsdp"  # how several processes hold the model: fsdp or ddp
    output_dir: str = "output"  # where a preempted run saves its checkpoint and metrics.jsonl goes
    max_restarts: int = 0  # Ray: relaunches after a worker dies
    ray_address: str | None = None  # Ray: the cluster to join; None: $RAY_ADDRESS, else a local one
    ray_placement: str = "pack"  # Ray: "pack" or "spread" the workers over the nodes
    max_grad_norm: float = 1.0  # clip_grad_and_step's gradient-norm bound when the call gives none
    model_cls: str | None = None  # the transformers class to load; None: AutoModelForCausalLM
    # A CLI-parsed run records its metrics (``twinkle.metric.report``): the --report-to sinks, ()
    # for the JSONL alone; None (a library call) records nothing.
    report_to: tuple[str, ...] | None = None
    resuming: bool = False  # the run resumes a checkpoint: its metrics.jsonl is appended to
    run_args: dict | None = None  # the parsed command line, saved next to the metrics


_DEFAULTS = [RunDefaults()]


def set_run_defaults(defaults: RunDefaults) -> None:
    """Make ``defaults`` this process's run defaults (the CLI calls this after parsing)."""
    _DEFAULTS[0] = defaults
    output_lock.arm(defaults)


def run_defaults() -> RunDefaults:
    return _DEFAULTS[0]


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


# torch seeds are 64-bit and each rank seeds with an offset added, so the run's seed stays below 2**63
MAX_SEED = 2**63 - 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _pick_device(local_rank: int) -> torch.device:
    kind = Torch.device_type()
    if kind == "cpu":
        return torch.device("cpu")
    # a Ray worker sees only its own GPU (CUDA_VISIBLE_DEVICES), so its index is 0 there
    device = torch.device(kind, local_rank % getattr(torch, kind).device_count())
    getattr(torch, kind).set_device(device)
    return device


def initialize(
    mode: str = "local",
    global_device_mesh: DeviceMesh | None = None,
    seed: int | None = None,
    timeout_s: int | None = None,
) -> Runtime:
    """Set up this process: seed, device (cuda > npu > cpu) and, under torchrun, the process group.

    ``seed`` defaults to the run defaults' (``--seed``, else 42). Every rank uses the same seed
    so that LoRA weights start identical on all ranks. ``timeout_s`` bounds how long a
    collective waits for a dead peer (default: the run defaults', ``--process-group-timeout``).

    A run whose command line the CLI parsed takes the lock on its ``--output-dir`` here, in rank 0
    or the Ray driver: a second run into that folder is refused (``output_lock``)."""
    global _RUNTIME
    if mode not in MODES:
        raise UserError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise UserError(f"initialize(seed=...): must be an integer in [0, 2**63 - 1], got {seed!r}")
    ray_worker = os.environ.get(RAY_WORKER) == "1"
    if mode == "ray" and not ray_worker:
        # the driver: run this script on the workers and end with the job's exit code
        from twinkle.runtime.ray_job import run_job

        output_lock.take_for_run(run_defaults(), owner=True)  # held for the workers, who never ask
        raise SystemExit(run_job(global_device_mesh or DeviceMesh.from_sizes(), run_defaults()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = global_device_mesh or DeviceMesh.from_sizes(world_size=world)
    if mesh.world_size != world:
        raise UserError(
            f"the device mesh has {mesh.world_size} rank(s) ({mesh.describe()}) but this job has {world} "
            f"process(es); launch with torchrun --nproc_per_node {mesh.world_size} or change --fsdp-size/--dp-size"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    output_lock.take_for_run(run_defaults(), owner=rank == 0 and not ray_worker)
    device = _pick_device(local_rank)
    if world > 1 and not dist.is_initialized():
        if timeout_s is None:
            timeout_s = run_defaults().process_group_timeout_s
        backend = {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(shutdown)
    seed = run_defaults().seed if seed is None else seed
    seed_everything(seed)
    preemption.install()
    _RUNTIME = Runtime(mode=mode, mesh=mesh, rank=rank, local_rank=local_rank, device=device, seed=seed)
    return _RUNTIME


def get_runtime() -> Runtime:
    """The runtime of this process; a single-process CPU/GPU runtime if ``initialize`` was not called."""
    if _RUNTIME is None:
        output_lock.disarm()  # started by a library call, not by the script: no run to lock for
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
