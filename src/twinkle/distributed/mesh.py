"""``DeviceMesh``: how the processes of a job are arranged (replicate x shard)."""

import operator
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.utils.errors import UserError
from twinkle.utils.platform import Platform

# upstream Twinkle's other parallel dimensions: accepted at 1 (or None), refused above
_UNSUPPORTED = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
    "etp": "expert tensor parallelism",
    "vpp": "virtual pipeline parallelism",
    "ulysses": "Ulysses sequence parallelism",
}
_MESH_DIMS = ("dp", "fsdp", "tp", "pp", "cp", "ep")  # the names upstream's mesh_dim_names may use


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _reject_unsupported(sizes: dict[str, Any], sequence_parallel: bool = False) -> None:
    """UserError for any of upstream's other parallel sizes above 1 (``sizes``: name -> size)."""
    for name, size in sizes.items():
        if size is None:
            continue
        dim = name.removesuffix("_size")
        size = _size(size, name)
        if size > 1:
            raise UserError(
                f"DeviceMesh: {name}={size} is not supported yet: {name} ({_UNSUPPORTED[dim]}); "
                f"Twinkle arranges ranks as dp replicas x fsdp shards only, so leave {name} at 1 or None"
            )
    if sequence_parallel:
        raise UserError(
            "DeviceMesh: sequence_parallel=True is not supported yet: sequence_parallel "
            "(Megatron sequence parallelism); leave it False"
        )


def _device_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str):
        raise UserError(f"DeviceMesh: device_type must be a name such as 'cuda', got {device_type!r}")
    try:
        return Platform.get_platform(device_type).device_prefix()
    except UserError as err:
        raise UserError(f"DeviceMesh: device_type: {err}") from None


def _size(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        size = operator.index(value)
    except TypeError:
        raise UserError(f"DeviceMesh: {name} must be an integer, got {value!r}") from None
    if size < 1:
        raise UserError(f"DeviceMesh: {name} must be at least 1, got {size}")
    return size


def _sizes_from_mesh(mesh: Any, mesh_dim_names: Any) -> tuple[int, int]:
    """(fsdp_size, dp_size) of upstream's ``mesh=`` / ``mesh_dim_names=`` form, checked."""
    if mesh_dim_names is None:
        raise UserError(
            "DeviceMesh: mesh= needs mesh_dim_names=, one name per dimension, e.g. ('dp', 'fsdp')"
        )
    names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
    try:
        ranks = torch.as_tensor(mesh)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"DeviceMesh: mesh= must be a (nested) list or array of ranks: {err}") from None
    if ranks.is_floating_point() or ranks.is_complex() or ranks.dtype == torch.bool:
        raise UserError(f"DeviceMesh: mesh= must hold integer ranks, got dtype {ranks.dtype}")
    if len(names) != ranks.dim():
        raise UserError(
            f"DeviceMesh: mesh_dim_names {names} names {len(names)} dimension(s) but mesh= has "
            f"{ranks.dim()} (shape {tuple(ranks.shape)})"
        )
    for name in names:
        if name not in _MESH_DIMS:
            raise UserError(f"DeviceMesh: unknown mesh dimension {name!r}; known: {', '.join(_MESH_DIMS)}")
    if len(set(names)) != len(names):
        raise UserError(f"DeviceMesh: mesh_dim_names {names} repeats a name")
    shape = dict(zip(names, ranks.shape, strict=True))
    _reject_unsupported({name: shape[name] for name in names if name not in ("dp", "fsdp")})
    dp, fsdp = shape.get("dp", 1), shape.get("fsdp", 1)
    if dp * fsdp == 0:
        raise UserError(f"DeviceMesh: mesh= holds no ranks (shape {tuple(ranks.shape)})")
    # move the dimensions to (dp, fsdp, the others of size 1) and read the ranks in that order
    order = [names.index(n) for n in ("dp", "fsdp") if n in shape] + [
        i for i, n in enumerate(names) if n not in ("dp", "fsdp")
    ]
    found = ranks.permute(order).reshape(-1).tolist()
    world = dp * fsdp
    if sorted(found) != list(range(world)):
        raise UserError(f"DeviceMesh: mesh= must hold each of the ranks 0..{world - 1} once, got {found}")
    if found != list(range(world)):
        raise UserError(
            "DeviceMesh: this rank layout is not supported yet: mesh= must put rank "
            "dp_index * fsdp_size + fsdp_index at each (dp, fsdp) place, e.g. "
            f"np.arange({world}).reshape({dp}, {fsdp}) with mesh_dim_names=('dp', 'fsdp')"
        )
    return fsdp, dp


@dataclass(frozen=True, init=False)
class DeviceMesh:
    """A 2-D arrangement of ranks: ``dp_size`` replicas, each sharded over ``fsdp_size`` ranks.

    Rank ``r`` sits at row ``r // fsdp_size`` (its replica) and column ``r % fsdp_size`` (its
    shard). Every rank reads different data, so the data-parallel world is the whole mesh.

    Build it from the sizes, ``DeviceMesh(fsdp_size=2, dp_size=2)``, or in upstream Twinkle's
    form, ``DeviceMesh(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=('dp', 'fsdp'))``:
    the same mesh. Upstream's other parallel sizes (``ulysses_size``, ``ep_size``, ...) are
    accepted at 1 or None and refused above. ``device_type`` is checked and kept but takes no
    part in equality: the runtime picks the device (cuda > npu > cpu)."""

    fsdp_size: int
    dp_size: int
    device_type: str | None = field(default=None, compare=False)

    def __init__(
        self,
        fsdp_size: int | None = None,
        dp_size: int | None = None,
        device_type: str | None = None,
        *,
        mesh: Any = None,
        mesh_dim_names: Any = None,
        ep_size: int | None = None,
        etp_size: int | None = None,
        vpp_size: int | None = None,
        ulysses_size: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        _reject_unsupported(
            {"ep_size": ep_size, "etp_size": etp_size, "vpp_size": vpp_size, "ulysses_size": ulysses_size},
            sequence_parallel,
        )
        if mesh is not None:
            if fsdp_size is not None or dp_size is not None:
                raise UserError("DeviceMesh: give fsdp_size/dp_size or mesh=/mesh_dim_names=, not both")
            fsdp_size, dp_size = _sizes_from_mesh(mesh, mesh_dim_names)
        elif mesh_dim_names is not None:
            raise UserError(
                "DeviceMesh: mesh_dim_names= needs mesh= (the ranks, e.g. np.arange(4).reshape(2, 2))"
            )
        elif fsdp_size is None or dp_size is None:
            raise UserError(
                "DeviceMesh needs fsdp_size and dp_size (or mesh= and mesh_dim_names=); "
                "DeviceMesh.from_sizes infers a missing size from the world size"
            )
        object.__setattr__(self, "fsdp_size", _size(fsdp_size, "fsdp_size"))
        object.__setattr__(self, "dp_size", _size(dp_size, "dp_size"))
        object.__setattr__(self, "device_type", _device_type(device_type))

    @classmethod
    def from_sizes(
        cls,
        fsdp_size: int | None = None,
        dp_size: int | None = None,
        world_size: int | None = None,
        *,
        tp_size: int | None = None,
        pp_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        etp_size: int | None = None,
        vpp_size: int | None = None,
        ulysses_size: int | None = None,
        sequence_parallel: bool = False,
        device_type: str | None = None,
    ) -> "DeviceMesh":
        """Build a mesh; a size left ``None`` is inferred from the world size.

        ``world_size`` defaults to ``$WORLD_SIZE`` (set by torchrun and by the Ray workers). A
        process no launcher started (no ``$WORLD_SIZE``: one process, or the driver of a Ray job,
        which starts the workers itself) takes the sizes as given, a size left ``None`` as 1;
        ``initialize`` then checks the mesh against the processes it finds.

        Upstream's other sizes (``tp_size``, ``pp_size``, ``cp_size``, ``ep_size``,
        ``etp_size``, ``vpp_size``, ``ulysses_size``) may be 1 or None; above 1 they raise, as
        does ``sequence_parallel=True``."""
        _reject_unsupported(
            {
                "tp_size": tp_size,
                "pp_size": pp_size,
                "cp_size": cp_size,
                "ep_size": ep_size,
                "etp_size": etp_size,
                "vpp_size": vpp_size,
                "ulysses_size": ulysses_size,
            },
            sequence_parallel,
        )
        for flag, size in (("--fsdp-size", fsdp_size), ("--dp-size", dp_size)):
            if size is not None and size < 1:
                raise UserError(f"{flag} must be at least 1, got {size}")
        if world_size is None and "WORLD_SIZE" not in os.environ:
            return cls(fsdp_size=fsdp_size or 1, dp_size=dp_size or 1, device_type=device_type)
        world = _env_world_size() if world_size is None else world_size
        if fsdp_size is None and dp_size is None:
            fsdp_size, dp_size = world, 1
        elif fsdp_size is None:
            fsdp_size = world // dp_size if world % dp_size == 0 else 0
        elif dp_size is None:
            dp_size = world // fsdp_size if world % fsdp_size == 0 else 0
        if fsdp_size * dp_size != world:
            if fsdp_size and dp_size:
                problem = (
                    f"--fsdp-size {fsdp_size} x --dp-size {dp_size} = {fsdp_size * dp_size} does not match"
                )
            else:  # a size left to be inferred came out 0: the given one does not divide the world
                flag, given = ("--fsdp-size", fsdp_size) if fsdp_size else ("--dp-size", dp_size)
                problem = f"{flag} {given} does not divide"
            raise UserError(
                f"{problem} the {world} process(es) of this job; launch with torchrun --nproc_per_node "
                f"{max(1, (fsdp_size or 1) * (dp_size or 1))} or change the sizes"
            )
        return cls(fsdp_size=fsdp_size, dp_size=dp_size, device_type=device_type)

    @property
    def world_size(self) -> int:
        return self.fsdp_size * self.dp_size

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(replica index, shard index) of ``rank``."""
        return divmod(rank, self.fsdp_size)

    def describe(self) -> str:
        if self.world_size == 1:
            return "single process (no sharding)"
        return f"{self.dp_size} replica(s) x {self.fsdp_size} shard(s) = {self.world_size} ranks"

    # ------------------------------------------------------------ upstream Twinkle's queries

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks as a ``(dp_size, fsdp_size)`` tensor (upstream: a numpy array)."""
        return torch.arange(self.world_size).reshape(self.dp_size, self.fsdp_size)

    @property
    def mesh_dim_names(self) -> tuple[str, str]:
        return ("dp", "fsdp")

    def has_dim(self, dim_name: str) -> bool:
        return dim_name in self.mesh_dim_names

    def get_dim_size(self, dim_name: str) -> int:
        if dim_name == "dp":
            return self.dp_size
        if dim_name == "fsdp":
            return self.fsdp_size
        raise UserError(f"DeviceMesh: no dimension {dim_name!r}; this mesh has {self.mesh_dim_names}")

    @property
    def dp_world_size(self) -> int:
        return self.dp_size

    @property
    def fsdp_world_size(self) -> int:
        return self.fsdp_size

    def _this_rank(self) -> int | None:
        rank = Platform.get_rank()
        return rank if 0 <= rank < self.world_size else None

    @property
    def dp_rank(self) -> int | None:
        """This process's replica index; None when ``$RANK`` is unset or outside the mesh."""
        rank = self._this_rank()
        return None if rank is None else self.coordinates(rank)[0]

    @property
    def fsdp_rank(self) -> int | None:
        """This process's shard index; None when ``$RANK`` is unset or outside the mesh."""
        rank = self._this_rank()
        return None if rank is None else self.coordinates(rank)[1]

    @property
    def is_single_process(self) -> bool:
        return self.world_size == 1 and "RANK" not in os.environ

    @property
    def data_world_size(self) -> int:
        """How many different data streams the job reads: every rank reads its own."""
        return self.world_size

    def get_data_rank_from_global_rank(self, global_rank: int) -> int:
        """Which data stream ``global_rank`` reads: ``replica * fsdp_size + shard``, its rank."""
        if not 0 <= global_rank < self.world_size:
            raise UserError(
                f"DeviceMesh: rank {global_rank} is not in this mesh of {self.world_size} rank(s) "
                f"({self.describe()})"
            )
        replica, shard = self.coordinates(global_rank)
        return replica * self.fsdp_size + shard

    @property
    def data_rank(self) -> int:
        """This process's data stream (``$RANK``); 0 in a process no launcher started."""
        rank = self._this_rank()
        return 0 if rank is None else self.get_data_rank_from_global_rank(rank)

    def get_slice(self, total_length: int, rank: int | None = None) -> slice:
        """The contiguous part of ``total_length`` items that data rank ``rank`` (default: this
        process's) reads; the first ``total_length % data_world_size`` parts are one longer."""
        world = self.data_world_size
        if rank is None:
            rank = self.data_rank
        if not 0 <= rank < world:
            raise UserError(f"DeviceMesh.get_slice: data rank {rank} is not in 0..{world - 1}")
        base, extra = divmod(total_length, world)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (1 if rank < extra else 0))
