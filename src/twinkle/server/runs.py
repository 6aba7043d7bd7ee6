"""What several route families do with training runs: check the base model and the tenant's
limits, start a run, and show a checkpoint's record as the SDK reads it."""

from datetime import UTC, datetime

from twinkle.server.common import serves
from twinkle.server.errors import BadRequest, NotFound, TooMany
from twinkle.server.requests import field
from twinkle.server.service import Server
from twinkle.server.state import Run, Tenant

# the user_metadata key naming a folder that also receives a run's checkpoints (save_dir)
SAVE_DIR = "twinkle_save_dir"


def iso(t: float) -> str:
    """A time in seconds since the epoch as the SDK reads it (ISO 8601, UTC)."""
    return datetime.fromtimestamp(t, UTC).isoformat()


def checkpoint_json(c: dict) -> dict:
    """A checkpoint's record (``Registry.checkpoints``) with its times in ISO 8601."""
    return {**c, "time": iso(c["time"]), "expires_at": iso(c["expires_at"]) if c["expires_at"] else None}


def check_base(s: Server, data: dict) -> str:
    """The request's ``base_model`` (default: the served one; ``common.serves``: another name of
    it); another model is ``NotFound``."""
    base = field(data, "base_model", str, default=s.base_model)
    if not serves(s.base_model, base):
        raise NotFound(f"base_model {base!r} is not served here; this server serves {s.base_model!r}")
    return base


def open_run(s: Server, tenant: Tenant, rank: int) -> int:
    """``rank`` if the tenant may open one more run of it; else 429 (its limit) or 400 (rank).

    The limit counts every run of the key that holds a slot (live) or resumes on its next request
    (parked: idle, or from before a restart); an unloaded run does not count. The 429 carries
    ``x-should-retry: false``: the same request fails until the tenant unloads a run."""
    mine = s.registry.runs_of(tenant.id)
    live = sum(r.live for r in mine)
    parked = sum(not r.live and r.parked is not None for r in mine)
    if live + parked >= tenant.limits.max_adapters:
        raise TooMany(
            f"this key has {live} live and {parked} parked training runs, its max_adapters limit is "
            f"{tenant.limits.max_adapters}; unload one (unload_model: a parked run counts until it is "
            "unloaded) or ask for a higher max_adapters"
        )
    if not 1 <= rank <= s.config.max_r:
        raise BadRequest(f"lora rank {rank} is out of range; this server takes 1..{s.config.max_r} (--max-r)")
    return rank


def start_run(
    s: Server,
    tenant: Tenant,
    base: str,
    rank: int,
    seed: int = 0,
    run_id: str | None = None,
    user_metadata: dict | None = None,
) -> Run:
    """A new live run with its adapter on the model (in the worker: the limit is checked again; when
    every slot is taken, the least recently used run is parked for it)."""
    open_run(s, tenant, rank)
    s.make_room()
    run = s.registry.new_run(tenant, base, rank, seed, run_id, user_metadata)
    try:
        s.engine.add(run.adapter, rank)
    except Exception:  # no slot for it (or a bad config): the run never existed
        s.registry.discard(run)
        raise
    return run
