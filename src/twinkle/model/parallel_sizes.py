"""The parallel sizes of a parsed command line (``--tp-size``, ``--ulysses-size``, ...) checked by
the model that would run them: a size above 1 that it cannot honour is refused in one line naming
the alternative, whether or not the script put it into its mesh. (The mesh it was given is
checked by ``twinkle.distributed.mesh.refuse_unimplemented``.)"""

from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

# flag -> (what it is, what runs instead)
ALTERNATIVES = {
    "tp_size": ("tensor parallelism", "shard the model with --fsdp-size instead"),
    "pp_size": ("pipeline parallelism", "shard the model with --fsdp-size instead"),
    "cp_size": ("context parallelism", "shard the model with --fsdp-size instead"),
    "ep_size": ("expert parallelism", "FSDP2 shards the experts with the rest of the model (--fsdp-size)"),
    "ulysses_size": (
        "Ulysses sequence parallelism",
        "shard the model with --fsdp-size and lower --max-length",
    ),
}
# flag -> the mesh keyword that runs it, for the sizes a model runs from its mesh
MESH_KEYWORDS = {"ulysses_size": "ulysses_size", "ep_size": "ep_size"}


def refuse_cli_sizes(run_args: dict[str, Any] | None, who: str, runs: dict[str, int] | None = None) -> None:
    """One ``UserError`` line for the first size above 1 on the command line (``run_args``: the
    run's parsed arguments, ``RunDefaults.run_args``; None when the script parsed none).
    ``runs``: the sizes ``who`` runs, as its mesh holds them (flag name -> size); a command-line
    size the mesh left out is refused, naming the mesh keyword."""
    infra = (run_args or {}).get("infra") or {}
    for name, (what, instead) in ALTERNATIVES.items():
        size = infra.get(name)
        if name in (runs or {}):
            if isinstance(size, int) and size > 1 and size != runs[name]:
                raise UserError(
                    f"--{name.replace('_', '-')} {size}: the mesh {who} runs has {name}={runs[name]}; build "
                    f"it with DeviceMesh.from_sizes(..., {MESH_KEYWORDS[name]}=args.infra.{name})"
                )
            continue
        if isinstance(size, int) and size > 1:
            raise UserError(
                f"--{name.replace('_', '-')} {size}: {who} does not run {what} yet; {instead} "
                f"(or drop --{name.replace('_', '-')})"
            )
    if infra.get("sequence_parallel"):
        # reached with --tp-size 1 only: Megatron's sequence parallelism has nothing to split
        get_logger().warning(
            "--sequence-parallel: %s ignores it with --tp-size 1 (it splits activations between "
            "tensor-parallel ranks)",
            who,
        )
