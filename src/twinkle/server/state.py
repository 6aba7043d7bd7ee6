"""Tenants, their training runs and checkpoints, and the queue of their requests.

A tenant is an API key; it is known by the key's SHA-256 (``Tenant.id``, the key itself is
never stored). Its runs and checkpoints live under ``output_dir/<tenant id>/<run id>/``:
``run.json`` (base model, LoRA rank), ``weights/<name>`` (``save_state``: adapter and optimizer)
and ``sampler_weights/<name>`` (adapter only). Each save is written under a temporary name and
renamed into place, so whatever a kill leaves, every listed checkpoint is whole; a restart
reads the runs back from the folders.

``Queue``: one worker thread runs the requests one at a time, taking the tenants in turn (round
robin over those with work waiting), each tenant's requests in the order they came."""

import collections
import hashlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import MARKER
from twinkle.server.errors import NotFound, TooMany

KINDS = {"weights": "training", "sampler_weights": "sampler"}


@dataclass
class Limits:
    max_adapters: int = 4  # live training runs per key
    max_datums: int = 512  # per forward_backward
    max_tokens: int = 65536  # per forward_backward
    rate: float = 50.0  # requests per second, sustained (a bucket of 4 s worth)


@dataclass
class Tenant:
    id: str
    limits: Limits
    tokens: float = 0.0
    refilled: float = field(default_factory=time.monotonic)

    def take(self) -> None:
        """One request from the rate bucket; ``TooMany`` when it is empty."""
        now = time.monotonic()
        cap = self.limits.rate * 4
        self.tokens = min(cap, self.tokens + (now - self.refilled) * self.limits.rate)
        self.refilled = now
        if self.tokens < 1:
            raise TooMany(
                f"rate limit of {self.limits.rate:g} requests/s for this key reached; retry shortly"
            )
        self.tokens -= 1


def tenant_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class Run:
    id: str
    tenant: str
    base_model: str
    rank: int
    created: float
    last_request: float
    adapter: str = ""  # its adapter's name on the model (the LoRA initialisation follows it)
    live: bool = False  # its adapter holds a slot in this process
    parked: str | None = None  # idle: saved here and its slot freed; reloaded on its next request


class Registry:
    """Runs by id (every tenant's), read back from ``root`` at start."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: dict[str, Run] = {}
        for meta in sorted(root.glob("*/*/run.json")):
            data = json.loads(meta.read_text())
            self.runs[data["id"]] = Run(**{**data, "live": False, "parked": None})

    def folder(self, run: Run) -> Path:
        return self.root / run.tenant / run.id

    def new_run(
        self, tenant: Tenant, base_model: str, rank: int, seed: int = 0, run_id: str | None = None
    ) -> Run:
        """A new run; its adapter is named after the tenant, the LoRA ``seed`` and how many
        runs the tenant made with that seed before, so the same requests start from the same
        weights on any server."""
        now = time.time()
        stem = f"t{tenant.id[:8]}-s{seed}-"
        count = sum(r.tenant == tenant.id and r.adapter.startswith(stem) for r in self.runs.values())
        run = Run(
            run_id or uuid.uuid4().hex[:16],
            tenant.id,
            base_model,
            rank,
            now,
            now,
            f"{stem}{count}",
            live=True,
        )
        folder = self.folder(run)
        folder.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in run.__dict__.items() if k not in ("live", "parked")}
        (folder / "run.json").write_text(json.dumps(data))
        self.runs[run.id] = run
        return run

    def run_of(self, tenant: Tenant, run_id: str, live: bool = True) -> Run:
        """The tenant's run ``run_id``; another tenant's or an unknown one is ``NotFound``."""
        run = self.runs.get(run_id)
        if run is None or run.tenant != tenant.id:
            raise NotFound(f"model_id {run_id!r} is not one of this key's training runs")
        if live and not run.live and run.parked is None:
            raise NotFound(
                f"training run {run_id!r} is not loaded (the server restarted); "
                "create a training client from one of its saved checkpoints"
            )
        run.last_request = time.time()
        return run

    def checkpoint(self, tenant: Tenant, path: str) -> tuple[Run, str, Path]:
        """(run, kind, folder) of ``tinker://<run>/<kind>/<name>``; ``NotFound`` unless it is this
        tenant's and saved whole (its completion marker is there)."""
        parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not parts[2] or parts[2].startswith("."):
            raise NotFound(
                f"{path!r} is not a checkpoint path (tinker://<run>/weights|sampler_weights/<name>)"
            )
        run = self.runs.get(parts[0])
        folder = self.folder(run) / parts[1] / parts[2] if run else None
        if run is None or run.tenant != tenant.id or not (folder / MARKER).is_file():
            raise NotFound(f"checkpoint {path!r} does not exist for this key")
        return run, parts[1], folder

    def log(self, run: Run, record: dict[str, Any]) -> None:
        """One line of the run's ``metrics.jsonl``."""
        with open(self.folder(run) / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def checkpoints(self, run: Run) -> list[dict[str, Any]]:
        out = []
        for kind, type_ in KINDS.items():
            for folder in sorted((self.folder(run) / kind).glob("[!.]*")):
                if not (folder / MARKER).is_file():  # only whole checkpoints (a save renames it in)
                    continue
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{folder.name}",
                        "checkpoint_type": type_,
                        "time": folder.stat().st_mtime,
                        "tinker_path": f"tinker://{run.id}/{kind}/{folder.name}",
                        "size_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
                    }
                )
        return out


class Future:
    def __init__(self, tenant: str):
        self.tenant = tenant
        self.done = threading.Event()
        self.result: Any = None  # a JSON-able dict, or bytes of a protobuf message
        self.error: tuple[str, str] | None = None  # (message, "user" | "server")


class Queue:
    """Fair time-slicing of the model across tenants; see the module docstring."""

    def __init__(self):
        self.pending: dict[str, collections.deque] = collections.OrderedDict()
        self.futures: dict[str, Future] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.step_times: collections.deque = collections.deque(maxlen=100)
        self.worker = threading.Thread(target=self._loop, name="twinkle-server-worker", daemon=True)
        self.worker.start()

    def submit(self, tenant: str, fn: Any) -> str:
        request_id = uuid.uuid4().hex
        with self.cond:
            self.futures[request_id] = Future(tenant)
            self.pending.setdefault(tenant, collections.deque()).append((request_id, fn))
            self.cond.notify()
        return request_id

    def depth(self) -> int:
        with self.cond:
            return sum(len(q) for q in self.pending.values())

    def future(self, tenant: str, request_id: str) -> Future:
        fut = self.futures.get(request_id)
        if fut is None or fut.tenant != tenant:
            raise NotFound(f"request_id {request_id!r} is not one of this key's requests")
        return fut

    def _next(self) -> tuple[str, Any] | None:
        with self.cond:
            while not self.stopped and not self.pending:
                self.cond.wait()
            if self.stopped:
                return None
            tenant, jobs = next(iter(self.pending.items()))
            job = jobs.popleft()
            del self.pending[tenant]
            if jobs:  # to the back of the line: the other tenants go first
                self.pending[tenant] = jobs
            return job

    def _loop(self) -> None:
        from twinkle.utils.errors import UserError

        while (job := self._next()) is not None:
            request_id, fn = job
            fut = self.futures[request_id]
            start = time.perf_counter()
            try:
                fut.result = fn()
            except (UserError, ValueError) as exc:
                fut.error = (str(exc).splitlines()[0] if str(exc) else type(exc).__name__, "user")
            except Exception as exc:  # noqa: BLE001 (one tenant's failure fails its request only)
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                fut.error = (message.splitlines()[0], "user" if hasattr(exc, "status") else "server")
            self.step_times.append(time.perf_counter() - start)
            fut.done.set()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
