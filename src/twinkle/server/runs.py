"""What several routes do with training runs: check the base model and the limits, start a run,
save one."""

import time
from typing import Any

from twinkle.server.app import field
from twinkle.server.checks import check_name
from twinkle.server.errors import BadRequest, NotFound, TooMany

MAX_TTL = 10 * 365 * 24 * 3600


def check_ttl(ttl: int | None) -> int | None:
    """A checkpoint TTL in seconds: None (never expires) or 1 s to 10 years."""
    if ttl is not None and not 1 <= ttl <= MAX_TTL:
        raise BadRequest(f"ttl_seconds must be 1..{MAX_TTL} (10 years) or null (never expires), got {ttl}")
    return ttl


def check_base(s: Any, data: dict) -> str:
    """The request's ``base_model`` (default: the served one); another is ``NotFound``."""
    base = field(data, "base_model", str, default=s.base_model)
    if base != s.base_model:
        raise NotFound(f"base_model {base!r} is not served here; this server serves {s.base_model!r}")
    return base


def open_run(s: Any, tenant: Any, rank: int) -> int:
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


def start_run(s: Any, tenant: Any, base: str, rank: int, seed: int = 0, run_id: str | None = None) -> Any:
    """A new live run with its adapter on the model (in the worker: the limit is checked again; when
    every slot is taken, the least recently used run is parked for it)."""
    open_run(s, tenant, rank)
    s.make_room()
    run = s.registry.new_run(tenant, base, rank, seed, run_id)
    try:
        s.engine.add(run.adapter, rank)
    except Exception:  # no slot for it (or a bad config): the run never existed
        s.registry.discard(run)
        raise
    return run


def save_options(data: dict) -> dict[str, Any]:
    """A save request's ``path`` (the name), ``ttl_seconds``, ``user_metadata`` and
    ``overwrite``, checked."""
    meta = field(data, "user_metadata", dict, default=None)
    if meta is not None and not all(isinstance(v, str) for v in meta.values()):
        raise BadRequest("user_metadata must map names to strings")
    name = field(data, "path", str, default=None)
    return {
        "name": check_name(name, "field 'path' (the checkpoint name)") if name else name,
        "ttl": check_ttl(field(data, "ttl_seconds", int, default=None)),
        "meta": meta,
        "overwrite": field(data, "overwrite", bool, default=True),
    }


def save(s: Any, run: Any, kind: str, optimizer: bool, name: str | None = None, **opts: Any) -> str:
    """Save the run's adapter as ``<kind>/<name>`` (a timestamped name by default); its path.
    ``opts`` (``save_options``): a TTL in seconds, user metadata, and whether an existing
    checkpoint of that name may be replaced (``overwrite``)."""
    name = name or f"{kind.split('_')[0]}-{int(time.time() * 1000)}"
    check_name(name, "the checkpoint name")
    folder = s.registry.folder(run) / kind / name
    if folder.exists() and not opts.get("overwrite", True):
        raise BadRequest(
            f"checkpoint {kind}/{name} exists already; pass overwrite=True or choose another name"
        )
    s.engine.save(run.adapter, folder, optimizer)
    ttl = opts.get("ttl")
    s.registry.annotate(
        run,
        f"{kind}/{name}",
        expires_at=None if ttl is None else time.time() + ttl,
        user_metadata=opts.get("meta"),
    )
    return f"tinker://{run.id}/{kind}/{name}"
