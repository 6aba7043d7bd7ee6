"""Tenants, their training runs and checkpoints, and the queue of their requests.

A tenant is an API key; it is known by the key's SHA-256 (``Tenant.id``, the key itself is
never stored). Its runs and checkpoints live under ``output_dir/<tenant id>/<run id>/``:
``run.json`` (base model, LoRA rank), ``weights/<name>`` (``save_state``: adapter and optimizer)
and ``sampler_weights/<name>`` (adapter only), ``checkpoints.json`` (their TTLs and user metadata). Each save
is written under a temporary name and renamed into place, so whatever a kill leaves, every
listed checkpoint is whole. A restart reads the runs back from the folders, each to be loaded
on its next request from its newest checkpoint (``weights`` first: adapter and AdamW state),
and the SDK clients' and samplers' ids from ``<tenant id>/clients.jsonl`` and
``samplers.jsonl``, so a client that outlives the server goes on with the same ids."""

import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import MARKER
from twinkle.server.checks import checkpoint_parts
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
                f"rate limit of {self.limits.rate:g} requests/s for this key reached; retry shortly",
                retry_after=(1 - self.tokens) / self.limits.rate,
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
    parked: str | None = None  # saved here and its slot freed; reloaded on its next request
    parked_optimizer: bool = True  # the reload restores the AdamW state too (a ``weights`` save)


PERSISTED = ("id", "tenant", "base_model", "rank", "created", "last_request", "adapter")


class Registry:
    """Runs by id (every tenant's), read back from ``root`` at start."""

    def __init__(self, root: Path, reporter: Any = None):
        self.root = root
        self.reporter = reporter  # twinkle.server.report.Reporter with --report-to
        self.runs: dict[str, Run] = {}
        self.clients: dict[str, str] = {}  # an SDK client's id (its session_id) -> tenant id
        self.samplers: dict[str, tuple[str, str | None]] = {}  # sampler id -> (tenant, path)
        for meta in sorted(root.glob("*/*/run.json")):
            data = json.loads(meta.read_text())
            run = Run(**{k: data[k] for k in PERSISTED})
            self.runs[run.id] = run
            self.purge_expired(run)
            run.parked, run.parked_optimizer = self.restore_point(run)
        for path in sorted(root.glob("*/clients.jsonl")):
            for line in path.read_text().splitlines():
                self.clients[json.loads(line)["id"]] = path.parent.name
        for path in sorted(root.glob("*/samplers.jsonl")):
            for line in path.read_text().splitlines():
                data = json.loads(line)
                self.samplers[data["id"]] = (path.parent.name, data["path"])

    def restore_point(self, run: Run) -> tuple[str | None, bool]:
        """Where a run not in memory resumes: its newest ``weights`` checkpoint (with the AdamW
        state), else its newest sampler weights (a fresh AdamW), else nowhere (None)."""
        for kind in KINDS:
            whole = [m for m in (self.folder(run) / kind).glob(f"[!.]*/{MARKER}") if m.is_file()]
            if whole:
                newest = max(whole, key=lambda m: m.stat().st_mtime)
                return str(newest.parent), kind == "weights"
        return None, True

    def remember_client(self, tenant: str, client_id: str) -> None:
        self.clients[client_id] = tenant
        self._append(self.root / tenant / "clients.jsonl", {"id": client_id})

    def remember_sampler(self, tenant: str, sampler_id: str, path: str | None) -> None:
        self.samplers[sampler_id] = (tenant, path)
        self._append(self.root / tenant / "samplers.jsonl", {"id": sampler_id, "path": path})

    @staticmethod
    def _append(path: Path, record: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

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
        data = {k: getattr(run, k) for k in PERSISTED}
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
                f"training run {run_id!r} has no saved state to resume from (it was unloaded, or the "
                "server restarted before it saved a checkpoint); create a new training client"
            )
        run.last_request = time.time()
        return run

    def checkpoint(self, tenant: Tenant, path: str) -> tuple[Run, str, Path]:
        """(run, kind, folder) of ``tinker://<run>/<kind>/<name>``; ``NotFound`` unless it is this
        tenant's and saved whole (its completion marker is there)."""
        parts = checkpoint_parts(path, KINDS)  # NotFound, or BadRequest for a name no save makes
        run = self.runs.get(parts[0])
        if run is not None and run.tenant == tenant.id:
            self.purge_expired(run)
        folder = self.folder(run) / parts[1] / parts[2] if run else None
        if run is None or run.tenant != tenant.id or not (folder / MARKER).is_file():
            raise NotFound(f"checkpoint {path!r} does not exist for this key")
        return run, parts[1], folder

    def log(self, run: Run, record: dict[str, Any]) -> None:
        """One line of the run's ``metrics.jsonl`` (and its scalars with ``--report-to``)."""
        with open(self.folder(run) / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        if self.reporter is not None:
            self.reporter.log(self.folder(run), record)

    # ---------------------------------------------------------------- TTLs and metadata
    def notes(self, run: Run) -> dict[str, dict[str, Any]]:
        """``{"<kind>/<name>": {"expires_at": time, "user_metadata": {...}}}`` of the run's
        checkpoints that have either (``checkpoints.json`` in the run's folder)."""
        path = self.folder(run) / "checkpoints.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def annotate(self, run: Run, checkpoint_id: str, **values: Any) -> None:
        """Set the checkpoint's notes (a None value removes that note)."""
        notes = self.notes(run)
        entry = {**notes.get(checkpoint_id, {}), **values}
        entry = {k: v for k, v in entry.items() if v is not None}
        if entry == notes.get(checkpoint_id, {}):
            return
        if entry:
            notes[checkpoint_id] = entry
        else:
            notes.pop(checkpoint_id, None)
        tmp = self.folder(run) / ".checkpoints.json.tmp"
        tmp.write_text(json.dumps(notes))
        tmp.replace(self.folder(run) / "checkpoints.json")

    def set_ttl(self, run: Run, checkpoint_id: str, ttl_seconds: float | None) -> None:
        """The checkpoint expires ``ttl_seconds`` from now (None: never)."""
        self.annotate(
            run, checkpoint_id, expires_at=None if ttl_seconds is None else time.time() + ttl_seconds
        )

    def forget(self, run: Run, checkpoint_id: str) -> None:
        """Delete the checkpoint and its notes."""
        shutil.rmtree(self.folder(run) / checkpoint_id, ignore_errors=True)
        self.annotate(run, checkpoint_id, expires_at=None, user_metadata=None)

    def purge_expired(self, run: Run) -> None:
        """Delete the run's checkpoints whose TTL has passed (checked whenever they are listed or
        looked up, and at start-up)."""
        now = time.time()
        for checkpoint_id, entry in self.notes(run).items():
            if entry.get("expires_at", now + 1) <= now:
                self.forget(run, checkpoint_id)

    def checkpoints(self, run: Run) -> list[dict[str, Any]]:
        self.purge_expired(run)
        notes = self.notes(run)
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
                        "expires_at": notes.get(f"{kind}/{folder.name}", {}).get("expires_at"),
                        "user_metadata": notes.get(f"{kind}/{folder.name}", {}).get("user_metadata"),
                    }
                )
        return out
