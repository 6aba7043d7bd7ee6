"""``Server``: the state one app serves from, reached by every route as
``request.app.state.server`` (``twinkle.server.requests.server_of``).

It holds the config, the ``Engine`` (the model, here or on Ray device groups), the tenants (one
per API key, each with its rate bucket), the ``Registry`` of runs, SDK clients and samplers, the
``Queue`` whose worker runs every call on the model, and the metrics. It owns the adapter slots'
lifecycle: a run's queued work loads it back first when it was parked (``on_run``), a full model
parks the least recently used run (``make_room``), and a run idle for ``--idle-timeout`` is
parked by a sweeper thread (``park``)."""

import contextlib
import hmac
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Request

from twinkle.server.config import ServerConfig
from twinkle.server.engine import Engine, build_engine
from twinkle.server.errors import NotFound, ServerError, TooMany, Unauthorized
from twinkle.server.metrics import ServerMetrics
from twinkle.server.queue import Queue
from twinkle.server.records import check_output_dir
from twinkle.server.report import Reporter
from twinkle.server.state import Registry, Tenant, tenant_id


class Server:
    """The app's state: config, engine, tenants, their runs, the SDK clients' ids and the samplers, and
    the queue."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None):
        self.config = config
        check_output_dir(config.output_dir)  # one error line before the model is built
        self.queue = Queue(
            max_seconds=config.max_request_seconds,
            future_ttl=config.future_ttl,
            max_queued=config.max_queued,
            # a paused sample holds an adapter slot: half of them at most, the rest for training
            max_started=max(1, config.max_loras // 2),
            on_done=lambda *a: self.metrics.done(*a),
        )
        if engine is None and config.mode == "local":  # the model computes on the queue's worker only
            engine = self.queue.call(lambda: build_engine(config))
        self.engine = engine or build_engine(config)  # --mode ray: Ray starts on the main thread
        self.base_model = config.model_id or "bundled:SmolLM2-135M-Instruct"
        self.tenants = {key: Tenant(tenant_id(key), limits) for key, limits in config.keys.items()}
        for t in self.tenants.values():
            t.tokens = t.limits.rate * 4
        if config.keyless:
            logging.getLogger("twinkle.server").warning(
                "twinkle server: no API keys, so one local user on %s takes any token (upstream's "
                "EMPTY_TOKEN included); pass --api-keys FILE to serve tenants",
                config.host,
            )
        config.output_dir.mkdir(parents=True, exist_ok=True)
        self.reporter = None
        if config.report_to:
            self.reporter = Reporter(config.report_to, config.output_dir)
        self.registry = Registry(config.output_dir, self.reporter)
        self.clients = self.registry.clients  # an SDK client's id (its session_id) -> tenant id
        self.samplers = self.registry.samplers  # sampler id -> (tenant, checkpoint path or None)
        self.metrics = ServerMetrics(self)
        if config.idle_timeout > 0:
            threading.Thread(target=self._sweep, name="twinkle-server-idle", daemon=True).start()

    # ---------------------------------------------------------------- runs on the model
    def on_run(self, tenant: Tenant, run: Any, fn: Any) -> str:
        """Queue ``fn`` for the run; a parked run (idle, or from before a restart) is first loaded
        back into a slot."""

        def job() -> Any:
            if not run.live and run.parked is not None and not Path(run.parked).is_dir():
                # its save was deleted (by the tenant, or a TTL): the newest one left, if any
                run.parked, run.parked_optimizer = self.registry.restore_point(run)
                if run.parked is None:
                    raise NotFound(f"training run {run.id!r} has no saved state left to resume from")
            if not run.live and run.parked is not None:
                self.make_room(keep=run)
                self.engine.add(run.adapter, run.rank)
                try:
                    self.engine.core.load(run.adapter, Path(run.parked), optimizer=run.parked_optimizer)
                except Exception:
                    self.engine.remove(run.adapter)
                    raise
                run.live, run.parked, run.parked_optimizer = True, None, True
            return fn()

        return self.queue.submit(tenant.id, job)

    def make_room(self, keep: Any = None) -> None:
        """A free adapter slot (in the worker): when every slot is taken, the live run whose last
        request is the oldest (not ``keep``) is parked; its next request loads it back."""
        if self.engine.free_slots():
            return
        live = [r for r in self.registry.runs_of() if r.live and r is not keep]
        if not live:
            raise ServerError(
                f"every adapter slot (--max-loras {self.config.max_loras}) is in use and none can be "
                "freed; retry shortly, or start the server with a higher --max-loras",
                status=503,
                retry_after=1.0,
            )
        self.park(min(live, key=lambda r: r.last_request), force=True)

    def park(self, run: Any, force: bool = False) -> None:
        """Save a run idle for ``--idle-timeout`` (or any live run, ``force``) as
        ``weights/parked-<ms>`` (adapter, AdamW state and any gradients of an open window), free
        its slot, and delete the run's older ``parked-`` saves."""
        idle = time.time() - run.last_request >= self.config.idle_timeout
        if not run.live or not (force or idle):
            return
        weights = self.registry.folder(run) / "weights"
        older = list(weights.glob("parked-*"))
        folder = weights / f"parked-{int(time.time() * 1000)}"
        self.engine.core.save(run.adapter, folder, optimizer=True)
        self.engine.remove(run.adapter)
        run.live, run.parked, run.parked_optimizer = False, str(folder), True
        for old in older:
            shutil.rmtree(old, ignore_errors=True)

    def _sweep(self) -> None:
        period = min(max(self.config.idle_timeout / 4, 0.05), 30.0)
        while not self.queue.stopped:
            time.sleep(period)
            now = time.time()
            for run in self.registry.runs_of():
                if run.live and now - run.last_request >= self.config.idle_timeout:
                    with contextlib.suppress(TooMany):  # its tenant's line is full: parked next time
                        self.queue.submit(run.tenant, lambda run=run: self.park(run))

    def auth(self, request: Request) -> Tenant:
        """The caller's tenant, one request taken from its rate bucket."""
        tenant = self.identify(request)
        tenant.take()
        return tenant

    def identify(self, request: Request) -> Tenant:
        """The caller's tenant (polling a future takes nothing from the rate bucket)."""
        if self.config.keyless:  # one local user, whatever token it sends (config.keyless_keys)
            return next(iter(self.tenants.values()))
        given = request.headers.get("x-api-key") or ""
        found = None
        for key, tenant in self.tenants.items():  # every key compared, whichever matches
            if hmac.compare_digest(key.encode(), given.encode()):
                found = tenant
        if found is None:
            raise Unauthorized(
                "missing or unknown API key; send a key the server was started with as X-API-Key"
            )
        return found


__all__ = ["Server"]
