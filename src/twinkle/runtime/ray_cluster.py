"""Joining or starting a Ray cluster and reserving its resources: what both Ray modes share.

``--mode ray`` as SPMD (``ray_job``: the driver starts one actor per rank that runs the script)
and as a single controller (``controller``: the driver runs the loop, objects live on groups of
actors) connect the same way (``--ray-address`` / ``$RAY_ADDRESS``, else a local cluster
started for the run) and reserve resources the same way: one placement group whose bundles
must be placed within ``PLACEMENT_SECONDS``, since Ray itself would wait forever."""

import os
import socket
from pathlib import Path
from typing import Any

from twinkle.utils.cache import cache_root
from twinkle.utils.errors import UserError

PLACEMENT_SECONDS = 30  # to reserve the workers' resources; Ray itself would wait forever
CONNECT_SECONDS = 5  # for an address to answer
# a local cluster may give ranks up to this many CPU slots per core (upstream's GKD script asks for
# three one-rank groups, which a small machine then still runs); more would only thrash
OVERSUBSCRIBE = 2
# what the workers get from the driver's environment, besides every TWINKLE_ variable
PASSED = ("PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def import_ray() -> Any:
    """The ``ray`` module, or one line naming the extra that installs it."""
    # read by Ray at import: every rank's lines, none folded into "[repeated Nx across cluster]"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError as exc:
        raise UserError("--mode ray needs Ray: pip install 'twinkle[ray]'") from exc
    return ray


def check_address(address: str) -> None:
    """One line, in seconds, for an address nothing answers at (Ray would retry for minutes)."""
    if address == "auto" or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_SECONDS):
            return
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--ray-address {address}: no Ray cluster answers there ({exc}); start one with "
            "`ray start --head`, fix the address, or leave it unset for a local cluster"
        ) from exc


def temp_dir() -> str:
    """The local cluster's files under the Twinkle cache; a short path elsewhere when that is too
    long for the cluster's Unix sockets (107 bytes with the names Ray appends)."""
    folder = cache_root() / "ray"
    if len(str(folder)) > 40:
        folder = Path("/tmp") / f"twinkle-ray-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def local_cpus(ranks: int) -> int | None:
    """CPU slots of a local cluster for ``ranks`` ranks of one CPU each: the machine's cores, or
    the ranks when they need more and at most ``OVERSUBSCRIBE`` times the cores (they then share
    cores); None leaves Ray's own count."""
    cores = os.cpu_count() or 1
    return ranks if cores < ranks <= OVERSUBSCRIBE * cores else None


def connect(ray: Any, address: str | None, cpus: int | None = None) -> bool:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local cluster (of ``cpus`` CPU slots
    where given); returns whether local."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_address(address)
        try:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
        except (ConnectionError, RuntimeError) as exc:
            cause = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            raise UserError(
                f"--ray-address {address}: cannot join that Ray cluster ({cause}); a cluster with token "
                "authentication needs RAY_AUTH_MODE=token and its token here (`ray get-auth-token`)"
            ) from exc
        return False
    slots = {} if cpus is None else {"num_cpus": cpus}
    ray.init(include_dashboard=False, _temp_dir=temp_dir(), configure_logging=False, **slots)
    return True


def place(ray: Any, bundles: list[dict[str, float]], strategy: str, refusal: str) -> Any:
    """A placement group of ``bundles`` (``strategy``: pack or spread), ready; ``refusal`` plus
    what the cluster has free, as one line, when it cannot be placed within ``PLACEMENT_SECONDS``."""
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy.upper())
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_SECONDS)
    if not ready:
        ray.util.remove_placement_group(group)
        raise UserError(
            f"{refusal} could not be placed within {PLACEMENT_SECONDS} s; the cluster has "
            f"{ray.available_resources()} free. Free resources, use fewer ranks, or try --ray-placement spread"
        )
    return group


def passed_environment() -> dict[str, str]:
    """The driver's variables a worker needs: every ``TWINKLE_`` one and ``PASSED``."""
    return {k: v for k, v in os.environ.items() if k.startswith("TWINKLE_") or k in PASSED}


def free_port_here() -> tuple[str, int]:
    """This node's address and a free port on it (a group's rank 0 hosts its process group)."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """(local rank, local world size) of each rank, by node."""
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        out.append((seen.get(node, 0), nodes.count(node)))
        seen[node] = seen.get(node, 0) + 1
    return out
