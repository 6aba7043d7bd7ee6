"""``--mode ray`` as a single controller: the driver runs the loop, objects live on device groups.

``twinkle.initialize(mode='ray', groups=[DeviceGroup(...)], ...)`` calls ``start``: it joins the
cluster (``--ray-address`` / ``$RAY_ADDRESS``) or starts a local one for the run, checks at once
that the groups fit the cluster's CPUs/GPUs, and reserves one placement group per device group
(a CPU, or a GPU and a CPU, per rank). It then returns to the script. An object created with
``remote_group='name'`` (``twinkle.runtime.remote``) starts that group's ranks, one
``GroupWorker`` actor each (``actors``), on first use; they form their own torch process group
(gloo on CPU, nccl on GPU) through ``twinkle.initialize`` inside each worker.

A call on the driver's proxy runs on every rank of the group in parallel; ``wait`` collects
them. A worker that died (killed, out of memory, a lost node) ends the run: every group's
workers are stopped and one line names the group and the rank; with ``--max-restarts K`` the
run is started again from its newest complete checkpoint instead, up to K times
(``controller_restarts``). At exit (``shutdown``) the actors are killed, the placement groups
removed, and a local cluster stopped."""

import atexit
import contextlib
import dataclasses
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkle.distributed.device_group import DeviceGroup
from twinkle.distributed.mesh import DeviceMesh
from twinkle.runtime import controller_restarts
from twinkle.runtime.actors import GroupWorker
from twinkle.runtime.ray_cluster import (
    connect,
    import_ray,
    local_cpus,
    local_ranks,
    passed_environment,
    place,
)
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

DEATH_GRACE_SECONDS = 10  # how long a group's other ranks may take to report after one failed


@dataclass
class GroupState:
    """A device group, its reservation and, once an object lives there, its workers."""

    spec: DeviceGroup
    kind: str  # the Ray resource of each rank: "CPU" or "GPU"
    reservation: Any
    mesh: DeviceMesh | None = None
    workers: list[Any] = field(default_factory=list)
    places: list[tuple[str, int, int, str]] = field(default_factory=list)

    @property
    def world(self) -> int:
        return len(self.spec.ranks)


class Controller:
    """The driver's view of the groups: their workers, and calls on them."""

    def __init__(self, ray: Any, local: bool, nproc_per_node: int | None, lazy_collect: bool) -> None:
        self.ray, self.local = ray, local
        self.nproc_per_node, self.lazy_collect = nproc_per_node, lazy_collect
        self.groups: dict[str, GroupState] = {}
        self.run: Any = None
        self.seed = 0
        self.default_mesh: DeviceMesh | None = None
        self.initialize: Callable[..., Any] | None = None  # what each rank calls to set itself up

    def group(self, name: str) -> GroupState:
        if name not in self.groups:
            raise UserError(
                f"remote_group={name!r}: no such device group; initialize(groups=...) has "
                f"{', '.join(repr(g) for g in self.groups)}"
            )
        return self.groups[name]

    # ------------------------------------------------------------- the ranks
    def mesh_for(self, state: GroupState, mesh: DeviceMesh | None) -> DeviceMesh:
        """The group's mesh: the first object's ``device_mesh``, else the run's global mesh when it
        has the group's size, else FSDP over all the group's ranks; later objects must agree."""
        name = state.spec.name
        if mesh is None:
            mesh = state.mesh or self.default_mesh
            if mesh is None or mesh.world_size != state.world:
                mesh = DeviceMesh(fsdp_size=state.world, dp_size=1)
        if mesh.world_size != state.world:
            raise UserError(
                f"device_mesh= ({mesh.describe()}) has {mesh.world_size} rank(s) but group {name!r} has "
                f"{state.world} ({list(state.spec.ranks)}); give the group's objects a mesh of its size"
            )
        if state.mesh is not None and mesh != state.mesh:
            raise UserError(
                f"device_mesh= ({mesh.describe()}) differs from the mesh group {name!r} already runs "
                f"({state.mesh.describe()}); the objects of one group share one mesh"
            )
        return mesh

    def ensure_workers(self, state: GroupState, mesh: DeviceMesh) -> None:
        """Start the group's ranks and set each up as a rank of the group's process group."""
        if state.workers:
            return
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 1 if state.kind == "GPU" else 0
        actor = self.ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(GroupWorker)
        state.workers = [
            actor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    state.reservation, placement_group_bundle_index=i
                )
            ).remote(state.spec.name, i, state.world)
            for i in range(state.world)
        ]
        state.places = self.ray.get([w.where.remote() for w in state.workers])
        state.mesh = mesh
        locals_ = local_ranks([where[3] for where in state.places])
        run = dataclasses.replace(self.run, lock_output_dir=False)  # the driver holds the lock
        self.wait(state, [
            w.setup.remote(_env(i, state, locals_[i]), mesh, self.seed, run, os.getcwd(), self.initialize)
            for i, w in enumerate(state.workers)
        ])  # fmt: skip
        get_logger().info(
            f"ray: group {state.spec.name!r}: {state.world} rank(s) on {state.kind} ({mesh.describe()})"
        )

    # ------------------------------------------------------------- calls
    def wait(self, state: GroupState, refs: list[Any]) -> list[Any]:
        """Every rank's value. A dead worker is the cause over a failed call: when one rank's call
        fails, the others get ``DEATH_GRACE_SECONDS`` to report, because a killed worker's peers
        see their collective cut off before Ray reports the death itself."""
        ray, name = self.ray, state.spec.name
        index = {ref: i for i, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        failed: tuple[int, str, str] | None = None
        pending = list(refs)
        while pending:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=None if failed is None else DEATH_GRACE_SECONDS
            )
            if not done:
                self.stop_all()  # ranks stuck in a collective with a rank that failed
                break
            rank = index[done[0]]
            try:
                status, value = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
                self.stop_all()
                message = f"ray: group {name!r} rank {rank}: the worker process died ({first[:200]})"
                controller_restarts.after_death(message)  # exits for a restart when one is left
                raise UserError(f"{message}; the run stops") from None
            if status != "ok" and failed is None:
                failed = (rank, status, value)
            values[rank] = value
        if failed is not None:
            rank, status, message = failed
            if status == "user":
                raise UserError(message)
            raise RuntimeError(f"ray: group {name!r} rank {rank}: {message}")
        return values

    def stop_all(self) -> None:
        for state in self.groups.values():
            for worker in state.workers:
                self.ray.kill(worker, no_restart=True)
            state.workers = []

    def new_key(self) -> str:
        return uuid.uuid4().hex

    def shutdown(self) -> None:
        """Kill every worker, remove the reservations and stop a local cluster. Safe twice."""
        global _CONTROLLER
        if _CONTROLLER is not self:
            return
        _CONTROLLER = None
        try:
            self.stop_all()
            for state in self.groups.values():
                self.ray.util.remove_placement_group(state.reservation)
        finally:
            self.ray.shutdown()

    # ------------------------------------------------------------- placement picture
    def placement(self) -> str:
        lines = [f"mode=ray single controller: {len(self.groups)} device group(s), driver on this process"]
        for name, state in self.groups.items():
            mesh = state.mesh.describe() if state.mesh else "no object yet"
            lines.append(f"  group {name!r}: ranks {list(state.spec.ranks)} on {state.kind} ({mesh})")
            for i, where in enumerate(state.places):
                lines.append(
                    f"    rank {i}: node {where[0]}, pid {where[2]}, device {state.spec.device_type}"
                )
        return "\n".join(lines)


_CONTROLLER: Controller | None = None


def active() -> Controller | None:
    """The single controller this driver runs, if any."""
    return _CONTROLLER


def _env(rank: int, state: GroupState, local: tuple[int, int]) -> dict[str, str]:
    master = state.places[0]
    env = passed_environment()
    env.update(
        TWINKLE_RAY_WORKER="1",
        RANK=str(rank),
        WORLD_SIZE=str(state.world),
        LOCAL_RANK=str(local[0]),
        LOCAL_WORLD_SIZE=str(local[1]),
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
    )
    return env


def _kind(group: DeviceGroup) -> str:
    return "CPU" if group.device_type == "cpu" else "GPU"


def check_fit(have: dict[str, float], groups: list[DeviceGroup]) -> None:
    """One line when the groups ask for more than the cluster has (every rank takes a CPU, and a
    GPU rank a GPU besides)."""
    cpus = sum(len(g.ranks) for g in groups)
    gpu_groups = [g for g in groups if _kind(g) == "GPU"]
    gpus = sum(len(g.ranks) for g in gpu_groups)
    asks = ", ".join(f"{g.name!r} {len(g.ranks)} {_kind(g)}(s)" for g in groups)
    if gpus and not have.get("GPU", 0):
        raise UserError(
            f"initialize(groups=...): group(s) {', '.join(repr(g.name) for g in gpu_groups)} ask for GPUs and "
            "this cluster has none; use DeviceGroup(device_type='CPU') or join a cluster with GPUs"
        )
    for kind, need in (("GPU", gpus), ("CPU", cpus)):
        if need > have.get(kind, 0):
            raise UserError(
                f"initialize(groups=...): the groups ask for {need} {kind}(s) in all ({asks}) and the "
                f"cluster has {have.get(kind, 0):g}; give the groups fewer ranks or add nodes"
            )


def start(
    groups: list[DeviceGroup],
    nproc_per_node: int | None,
    lazy_collect: bool,
    run: Any,
    seed: int,
    default_mesh: DeviceMesh | None,
    initialize: Callable[..., Any],
) -> Controller:
    """Connect, check the groups fit, reserve them; the driver then runs the script.

    ``initialize`` is the runtime's ``initialize``, which each rank's worker calls to set its
    process up: the runtime starts the controller and hands it over, so neither the controller
    nor its workers import the runtime module."""
    global _CONTROLLER
    if _CONTROLLER is not None:
        _CONTROLLER.shutdown()
    _install_one_line_hook()  # first, so that every refusal below is one line
    groups = _checked(groups)
    if controller_restarts.supervising(run):  # --max-restarts: this process runs the attempts
        raise SystemExit(controller_restarts.supervise(run))
    ray = import_ray()
    cpus = local_cpus(sum(len(g.ranks) for g in groups))
    local = connect(ray, run.ray_address, cpus)
    if local and cpus is not None:
        get_logger().warning(
            f"ray: the groups' {cpus} ranks share this machine's {os.cpu_count()} cores (a local cluster of "
            f"{cpus} CPU slots); they run, more slowly than on a core each"
        )
    controller = Controller(ray, local, nproc_per_node, lazy_collect)
    _CONTROLLER = controller
    atexit.register(controller.shutdown)
    controller.run, controller.seed, controller.default_mesh = run, seed, default_mesh
    controller.initialize = initialize
    check_fit(ray.cluster_resources(), groups)
    for spec in groups:
        kind = _kind(spec)
        bundle = {"CPU": 1.0, "GPU": 1.0} if kind == "GPU" else {"CPU": 1.0}
        refusal = f"group {spec.name!r}: {len(spec.ranks)} rank(s) of {bundle}"
        reservation = place(ray, [bundle] * len(spec.ranks), run.ray_placement, refusal)
        controller.groups[spec.name] = GroupState(spec, kind, reservation)
    return controller


def _checked(groups: Any) -> list[DeviceGroup]:
    if isinstance(groups, DeviceGroup):
        groups = [groups]
    groups = list(groups)
    if not groups or not all(isinstance(g, DeviceGroup) for g in groups):
        raise UserError(
            "initialize(groups=...): give a list of twinkle.DeviceGroup(name=..., ranks=..., ...)"
        )
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise UserError(f"initialize(groups=...): group names must be unique, got {names}")
    return groups


def _install_one_line_hook() -> None:
    """A single-controller script reports a ``UserError`` (a dead rank included) as one line."""
    previous = sys.excepthook

    def hook(kind: Any, exc: BaseException, tb: Any) -> None:
        if isinstance(exc, UserError):
            controller = active()
            if controller is not None:  # Ray forwards the workers' output until it stops: stop it first
                with contextlib.suppress(Exception):
                    controller.shutdown()
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        else:
            previous(kind, exc, tb)

    if getattr(previous, "__name__", "") != "hook":
        sys.excepthook = hook
