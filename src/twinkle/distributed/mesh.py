"""``DeviceMesh``: how the processes of a job are arranged (replicate x shard)."""

import os
from dataclasses import dataclass

from twinkle.utils.errors import UserError


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class DeviceMesh:
    """A 2-D arrangement of ranks: ``dp_size`` replicas, each sharded over ``fsdp_size`` ranks.

    Rank ``r`` sits at row ``r // fsdp_size`` (its replica) and column ``r % fsdp_size`` (its
    shard). Every rank reads different data, so the data-parallel world is the whole mesh."""

    fsdp_size: int
    dp_size: int

    @classmethod
    def from_sizes(
        cls, fsdp_size: int | None = None, dp_size: int | None = None, world_size: int | None = None
    ) -> "DeviceMesh":
        """Build a mesh; a size left ``None`` is inferred from the world size.

        ``world_size`` defaults to ``$WORLD_SIZE`` (set by torchrun and by the Ray workers). A
        process no launcher started (no ``$WORLD_SIZE``: one process, or the driver of a Ray job,
        which starts the workers itself) takes the sizes as given, a size left ``None`` as 1;
        ``initialize`` then checks the mesh against the processes it finds."""
        for flag, size in (("--fsdp-size", fsdp_size), ("--dp-size", dp_size)):
            if size is not None and size < 1:
                raise UserError(f"{flag} must be at least 1, got {size}")
        if world_size is None and "WORLD_SIZE" not in os.environ:
            return cls(fsdp_size=fsdp_size or 1, dp_size=dp_size or 1)
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
        return cls(fsdp_size=fsdp_size, dp_size=dp_size)

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
