"""What several routes do with training runs: check the base model and the limits, start a run,
save one."""

import shutil
import time
from typing import Any

from twinkle.server.app import field
from twinkle.server.errors import BadRequest, NotFound, TooMany


def check_base(s: Any, data: dict) -> str:
    """The request's ``base_model`` (default: the served one); another is ``NotFound``."""
    base = field(data, "base_model", str, default=s.base_model)
    if base != s.base_model:
        raise NotFound(f"base_model {base!r} is not served here; this server serves {s.base_model!r}")
    return base


def open_run(s: Any, tenant: Any, rank: int) -> int:
    """``rank`` if the tenant may open one more run of it; else 429 (its limit) or 400 (rank)."""
    live = sum(r.live and r.tenant == tenant.id for r in s.registry.runs.values())
    if live >= tenant.limits.max_adapters:
        raise TooMany(
            f"this key has {live} live training runs, its limit is {tenant.limits.max_adapters}; "
            "finish one (unload it) or ask for a higher max_adapters"
        )
    if not 1 <= rank <= s.config.max_r:
        raise BadRequest(f"lora rank {rank} is out of range; this server takes 1..{s.config.max_r} (--max-r)")
    return rank


def start_run(s: Any, tenant: Any, base: str, rank: int, seed: int = 0, run_id: str | None = None) -> Any:
    """A new live run with its adapter on the model (in the worker: the limit is checked again)."""
    open_run(s, tenant, rank)
    run = s.registry.new_run(tenant, base, rank, seed, run_id)
    try:
        s.engine.add(run.adapter, rank)
    except Exception:  # no slot for it (or a bad config): the run never existed
        del s.registry.runs[run.id]
        shutil.rmtree(s.registry.folder(run), ignore_errors=True)
        raise
    return run


def save(s: Any, run: Any, kind: str, name: str | None, optimizer: bool) -> str:
    """Save the run's adapter as ``<kind>/<name>`` (a timestamped name by default); its path."""
    name = name or f"{kind.split('_')[0]}-{int(time.time() * 1000)}"
    if "/" in name or name.startswith(".") or len(name) > 128:
        raise BadRequest(f"checkpoint name {name!r} must be a plain name (no '/', not starting with '.')")
    s.engine.save(run.adapter, s.registry.folder(run) / kind / name, optimizer)
    return f"tinker://{run.id}/{kind}/{name}"
