"""``Runtime``: mode, mesh, rank, device, seed and run configuration of this process, created
once by ``initialize``, the one place that applies a run's process-wide effects."""

import atexit
import datetime
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from twinkle.distributed.fsdp import release_process_groups
from twinkle.distributed.mesh import DeviceMesh
from twinkle.runtime import controller, controller_restarts, output_lock, preemption
from twinkle.runtime.run_config import RunDefaults, take_handed_over
from twinkle.utils.errors import UserError
from twinkle.utils.framework import Torch

MODES = ("local", "ray")
RAY_WORKER = "TWINKLE_RAY_WORKER"  # set in the processes a Ray job's driver starts


@dataclass
class Runtime:
    mode: str
    mesh: DeviceMesh
    rank: int
    local_rank: int
    device: torch.device
    seed: int
    defaults: RunDefaults = field(default_factory=RunDefaults)
    # this run's ``twinkle.metric.report.RunReport`` (rank 0 of a CLI-parsed run), made at its first
    # record and finished when the run ends or another ``initialize`` replaces this runtime
    report: Any = field(default=None, repr=False, compare=False)

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


def _device_of(local_rank: int) -> torch.device:
    """The device of the process of local rank ``local_rank`` (cuda > npu > cpu)."""
    kind = Torch.device_type()
    if kind == "cpu":
        return torch.device("cpu")
    # a Ray worker sees only its own GPU (CUDA_VISIBLE_DEVICES), so its index is 0 there
    return torch.device(kind, local_rank % getattr(torch, kind).device_count())


def _pick_device(local_rank: int) -> torch.device:
    device = _device_of(local_rank)
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    return device


def _launch() -> tuple[int, int, int]:
    """``(world size, rank, local rank)`` as the launcher (torchrun, Ray) set them; one process
    without one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))


def initialize(
    mode: str = "local",
    global_device_mesh: DeviceMesh | None = None,
    seed: int | None = None,
    timeout_s: int | None = None,
    *,
    run: RunDefaults | None = None,
    groups: Any = None,
    nproc_per_node: int | None = None,
    lazy_collect: bool = True,
) -> Runtime:
    """Set up this process for a run, and apply the run's configuration; nothing else in Twinkle
    changes process-wide state.

    The configuration is ``run``, else the one the CLI (``twinkle.cli``) parsed and handed over, else
    ``RunDefaults()`` (a library call). Its effects, in order:

    - for a command-line run, ``sys.excepthook`` printing a ``UserError`` as one line;
    - the lock on ``output_dir`` when the run owns it (``lock_output_dir``: the CLI's runs), taken
      in rank 0 or the Ray driver before the process group forms (``output_lock``);
    - under ``--mode ray``, in the driver: the job on the workers, then exit with its status;
    - the device (cuda > npu > cpu) and, under torchrun, the process group, whose collectives wait
      ``timeout_s`` (default ``process_group_timeout_s``) for a dead peer;
    - the seeds (``seed``, default the configuration's): every rank the same, so that LoRA weights
      start identical;
    - the SIGTERM handler that saves at the next step boundary (``preemption``).

    The configuration then lives in ``Runtime.defaults``, where components built afterwards read
    what their call leaves out (``run_defaults()``): dtype, activation checkpointing, strategy,
    model class, gradient clipping, skip-bad-rows and the metric sinks.

    ``mode='ray'`` with ``groups`` (a list of ``DeviceGroup``): this process is the single
    controller (``twinkle.runtime.controller``): it joins or starts the cluster, checks the
    groups fit, and returns; objects built with ``remote_group=`` then live on the groups.
    ``nproc_per_node`` is upstream's devices per node (recorded); ``lazy_collect=False``
    gathers per-rank outputs to the driver at once (``twinkle.runtime.remote``)."""
    handed = take_handed_over()  # an explicit ``run`` replaces it
    hook = None
    if run is None and handed is not None:
        run, hook = handed.defaults, handed.excepthook
    run = run or RunDefaults()
    if mode == "ray" and groups is not None and os.environ.get(RAY_WORKER) != "1":
        return _start_controller(global_device_mesh, seed, run, hook, (groups, nproc_per_node, lazy_collect))
    return _start(mode, global_device_mesh, seed, timeout_s, run, hook)


def _start_controller(
    mesh: DeviceMesh | None, seed: int | None, run: RunDefaults, hook: Any, how: tuple
) -> Runtime:
    """The driver of a single-controller run: a one-process runtime of its own, then the groups."""
    run = controller_restarts.for_attempt(run)  # an attempt's supervisor holds the output lock
    runtime = _start("local", None, seed, None, run, hook)
    runtime.mode = "ray"  # the driver took the output lock above, for the groups' workers too
    groups, nproc_per_node, lazy_collect = how
    controller.start(groups, nproc_per_node, lazy_collect, run, runtime.seed, mesh, initialize)
    return runtime


def _start(
    mode: str,
    global_device_mesh: DeviceMesh | None,
    seed: int | None,
    timeout_s: int | None,
    run: RunDefaults,
    excepthook: Any,
) -> Runtime:
    global _RUNTIME
    if excepthook is not None:  # first, so that every refusal below is one line
        sys.excepthook = excepthook
    if mode not in MODES:
        raise UserError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise UserError(f"initialize(seed=...): must be an integer in [0, 2**63 - 1], got {seed!r}")
    ray_worker = os.environ.get(RAY_WORKER) == "1"
    if mode == "ray" and not ray_worker:
        # the driver: run this script on the workers and end with the job's exit code
        from twinkle.runtime.ray_job import run_job

        output_lock.take_for_run(run, owner=True)  # held for the workers, who never ask
        raise SystemExit(run_job(global_device_mesh or DeviceMesh.from_sizes(), run))
    world, rank, local_rank = _launch()
    mesh = global_device_mesh or DeviceMesh.from_sizes(world_size=world)
    if mesh.world_size != world:
        raise UserError(
            f"the device mesh has {mesh.world_size} rank(s) ({mesh.describe()}) but this job has {world} "
            f"process(es); launch with torchrun --nproc_per_node {mesh.world_size} or change --fsdp-size/--dp-size"
        )
    output_lock.take_for_run(run, owner=rank == 0 and not ray_worker)
    device = _pick_device(local_rank)
    if world > 1 and not dist.is_initialized():
        if timeout_s is None:
            timeout_s = run.process_group_timeout_s
        backend = {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(shutdown)
    seed = run.seed if seed is None else seed
    seed_everything(seed)
    preemption.install(say_before_loop=not ray_worker)  # a Ray job's driver reports for its workers
    if _RUNTIME is not None and _RUNTIME.report is not None:  # the previous run in this process ends
        _RUNTIME.report.finish()
    _RUNTIME = Runtime(mode, mesh, rank, local_rank, device, seed, run)
    return _RUNTIME


def get_runtime() -> Runtime:
    """The runtime ``initialize`` set up. Before ``initialize`` (a library call), what this process
    is, with the default configuration, and nothing applied: no seeds, no device selected, no
    process group, no signal handler, no lock, and a parsed command line left waiting for
    ``initialize``. Nothing of it is kept, so a later ``initialize`` starts from a clean process;
    a process that torchrun started among several needs ``initialize`` for its process group."""
    if _RUNTIME is None:
        world, rank, local_rank = _launch()
        run = RunDefaults()
        mesh = DeviceMesh.from_sizes(world_size=world)
        return Runtime("local", mesh, rank, local_rank, _device_of(local_rank), run.seed, run)
    return _RUNTIME


def run_defaults() -> RunDefaults:
    """The run's configuration (``Runtime.defaults``), or ``RunDefaults()`` before ``initialize``."""
    return RunDefaults() if _RUNTIME is None else _RUNTIME.defaults


def shutdown() -> None:
    """Destroy the process groups, if any, and stop their backends' threads. Safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        release_process_groups()


def get_device_placement() -> str:
    """A readable picture of the mesh: which rank sits where, on which device; under a single
    controller, the device groups, their ranks, processes and devices."""
    if controller.active() is not None:
        return controller.active().placement()
    rt = get_runtime()
    mesh = rt.mesh
    lines = [f"mode={rt.mode} world_size={rt.world_size} device={rt.device.type} mesh: {mesh.describe()}"]
    for replica in range(mesh.dp_size):
        ranks = [replica * mesh.fsdp_size + shard for shard in range(mesh.fsdp_size)]
        lines.append(f"  replica {replica}: fsdp shards on ranks {ranks}")
    lines.append(f"  this process: rank {rt.rank} (local {rt.local_rank}) on {rt.device}")
    return "\n".join(lines)
