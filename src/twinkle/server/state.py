"""Tenants, their training runs and checkpoints, and the files that keep them across restarts.

A tenant is an API key; it is known by the key's SHA-256 (``Tenant.id``, the key itself is
never stored). Its runs and checkpoints live under ``output_dir/<tenant id>/<run id>/``:
``run.json`` (base model, LoRA rank), ``weights/<name>`` (``save_state``: adapter and optimizer)
and ``sampler_weights/<name>`` (adapter only), ``checkpoints.json`` (their TTLs and user
metadata). Each save is written under a temporary name and renamed into place, so whatever a kill
leaves, every listed checkpoint is whole; ``run.json`` and ``checkpoints.json`` are written the same
way (a flushed temporary file renamed over the old one, then the folder flushed), and each line of
``<tenant id>/clients.jsonl`` and ``samplers.jsonl`` (the SDK clients' and samplers' ids) is
flushed to disk as it is appended.

A restart reads the runs back from the folders, each to be loaded on its next request from its
newest checkpoint (``weights`` first: adapter and AdamW state), and the clients' and samplers'
ids, so a client that outlives the server goes on with the same ids. A record that cannot be read
(not JSON, not an object, a field of ``PERSISTED`` missing or of the wrong type, an id that is
not its folder's) is moved under ``output_dir/damaged/`` at the same relative path, with one
warning naming it, and every other tenant and run comes back: a damaged ``run.json`` takes its
whole run folder there (the checkpoints with it), a damaged ``checkpoints.json`` goes alone (the
run's checkpoints then have no TTL and no metadata: none expires), and the unreadable lines of a
``.jsonl`` go to a file of the same name there while the good lines stay. Nothing is deleted;
``damaged/`` is never read back. Reading and quarantining those records is ``twinkle.server.records``.

The registry never follows a symbolic link: a checkpoint folder (or a ``weights`` or
``sampler_weights`` folder) that is a link is not listed, not loaded, not resumed from and not
deleted (404). Deleting a checkpoint renames it to a hidden name first, so a failure leaves it
whole and listed and is an error.

``runs``, ``clients`` and ``samplers`` are changed only under ``Registry.lock``; the routes read
them through ``runs_of``, ``clients_of`` and ``samplers_of``, which copy them under it."""

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import MARKER
from twinkle.server.checks import checkpoint_parts
from twinkle.server.errors import NotFound, ServerError, TooMany
from twinkle.server.records import (
    DAMAGED,
    KINDS,
    PERSISTED,
    check_output_dir,
    client_record,
    fsync_dir,
    parse_notes,
    quarantine,
    read_lines,
    read_run,
    real_dir,
    sampler_record,
)
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import atomic_write_text
from twinkle.utils.logger import get_logger

logger = get_logger(__name__)


@dataclass
class Limits:
    max_adapters: int = 4  # training runs per key that hold a slot or can resume (live or parked)
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
    user_metadata: dict | None = None  # the client's own labels, listed with the run
    # its composite forward_backward calls since its last optim_step, which reports them
    # (``twinkle.server.objectives.Window``); kept in memory only, like the queue's futures
    window: Any = None


class Registry:
    """Runs by id (every tenant's), the SDK clients' and samplers' owners; read back from ``root``
    at start."""

    def __init__(self, root: Path, reporter: Any = None):
        check_output_dir(root)
        self.root = root
        self.reporter = reporter  # twinkle.server.report.Reporter with --report-to
        self.lock = threading.RLock()  # held for every change of the three maps below
        self.runs: dict[str, Run] = {}
        self.clients: dict[str, str] = {}  # an SDK client's id (its session_id) -> tenant id
        self.samplers: dict[str, tuple[str, str | None]] = {}  # sampler id -> (tenant, path)
        try:
            tenants = [d for d in sorted(root.iterdir()) if d.name != DAMAGED and real_dir(d)]
        except OSError as exc:
            raise UserError(f"--output-dir {root} cannot be read ({exc.strerror})") from None
        for tenant in list(tenants):
            try:
                folders = sorted(tenant.iterdir())
            except OSError as exc:  # that tenant only
                logger.warning(
                    f"twinkle server: {tenant} cannot be read ({exc.strerror}); its runs are not served"
                )
                tenants.remove(tenant)
                continue
            for folder in folders:  # a link is not a run folder of this server's
                meta = folder / "run.json"
                if real_dir(folder) and (meta.exists() or meta.is_symlink()):
                    data = read_run(self.root, folder, self.runs)
                    if data is not None:
                        meta = data.get("user_metadata")
                        self.runs[data["id"]] = Run(
                            **{k: data[k] for k in PERSISTED},
                            user_metadata=meta if isinstance(meta, dict) else None,
                        )
        for run in list(self.runs.values()):
            self.purge_expired(run)
            run.parked, run.parked_optimizer = self.restore_point(run)
        for tenant in tenants:
            for record in read_lines(root, tenant / "clients.jsonl", client_record):
                self.clients[record["id"]] = tenant.name
            for record in read_lines(root, tenant / "samplers.jsonl", sampler_record):
                self.samplers[record["id"]] = (tenant.name, record["path"])

    # ---------------------------------------------------------------- start-up: reading back
    def restore_point(self, run: Run) -> tuple[str | None, bool]:
        """Where a run not in memory resumes: its newest ``weights`` checkpoint (with the AdamW
        state), else its newest sampler weights (a fresh AdamW), else nowhere (None)."""
        for kind in KINDS:
            dated = []
            for folder in self._whole(run, kind):
                with contextlib.suppress(FileNotFoundError):
                    dated.append(((folder / MARKER).stat().st_mtime, folder))
            if dated:
                return str(max(dated)[1]), kind == "weights"
        return None, True

    # ---------------------------------------------------------------- reading under the lock
    def runs_of(self, tenant_id: str | None = None) -> list[Run]:
        """A copy of the tenant's runs (every tenant's with None), safe to iterate."""
        with self.lock:
            return [r for r in self.runs.values() if tenant_id is None or r.tenant == tenant_id]

    def check_client(self, tenant: Tenant, client_id: str) -> None:
        """``NotFound`` unless ``client_id`` is one of the tenant's SDK clients."""
        if self.clients.get(client_id) != tenant.id:
            raise NotFound(f"client {client_id!r} is not one of this key's")

    def sampler_path(self, tenant: Tenant, sampler_id: str) -> str | None:
        """The checkpoint path of the tenant's sampler ``sampler_id`` (None: the base model);
        ``NotFound`` for another tenant's or an unknown one."""
        owner, path = self.samplers.get(sampler_id, (None, None))
        if owner != tenant.id:
            raise NotFound(f"sampler {sampler_id!r} is not one of this key's")
        return path

    def clients_of(self, tenant_id: str) -> list[str]:
        with self.lock:
            return [c for c, t in self.clients.items() if t == tenant_id]

    def samplers_of(self, tenant_id: str) -> list[str]:
        with self.lock:
            return [k for k, (t, _) in self.samplers.items() if t == tenant_id]

    # ---------------------------------------------------------------- changes
    def remember_client(self, tenant: str, client_id: str) -> None:
        with self.lock:
            self.clients[client_id] = tenant
            self._append(self.root / tenant / "clients.jsonl", {"id": client_id})

    def remember_sampler(self, tenant: str, sampler_id: str, path: str | None) -> None:
        with self.lock:
            self.samplers[sampler_id] = (tenant, path)
            self._append(self.root / tenant / "samplers.jsonl", {"id": sampler_id, "path": path})

    @staticmethod
    def _append(path: Path, record: dict) -> None:
        """One line, flushed to disk; after a line a kill cut short (no newline at the end) it
        starts a line of its own."""
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record).encode() + b"\n"
        with open(path, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def folder(self, run: Run) -> Path:
        return self.root / run.tenant / run.id

    def new_run(
        self,
        tenant: Tenant,
        base_model: str,
        rank: int,
        seed: int = 0,
        run_id: str | None = None,
        user_metadata: dict | None = None,
    ) -> Run:
        """A new run; its adapter is named after the tenant, the LoRA ``seed`` and how many
        runs the tenant made with that seed before, so the same requests start from the same
        weights on any server."""
        now = time.time()
        stem = f"t{tenant.id[:8]}-s{seed}-"
        with self.lock:
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
                user_metadata=user_metadata,
            )
            folder = self.folder(run)
            folder.mkdir(parents=True, exist_ok=True)
            record = {k: getattr(run, k) for k in PERSISTED}
            if user_metadata is not None:
                record["user_metadata"] = user_metadata
            atomic_write_text(folder / "run.json", json.dumps(record))
            fsync_dir(folder)
            self.runs[run.id] = run
        return run

    def discard(self, run: Run) -> None:
        """Forget a run that never started (its adapter found no slot) and remove its folder."""
        with self.lock:
            self.runs.pop(run.id, None)
        shutil.rmtree(self.folder(run), ignore_errors=True)

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

    # ---------------------------------------------------------------- checkpoints
    def _whole(self, run: Run, kind: str) -> list[Path]:
        """The run's whole checkpoints of ``kind`` (their marker written), by name; hidden names
        (a save or a delete in progress) and links are not checkpoints."""
        base = self.folder(run) / kind
        if not real_dir(base):
            return []
        with contextlib.suppress(FileNotFoundError):
            return [
                f
                for f in sorted(base.iterdir())
                if not f.name.startswith(".") and real_dir(f) and (f / MARKER).is_file()
            ]
        return []

    def checkpoint(self, tenant: Tenant, path: str, read: bool = False) -> tuple[Run, str, Path]:
        """(run, kind, folder) of ``tinker://<run>/<kind>/<name>`` (or ``twinkle://``);
        ``NotFound`` unless it is this tenant's (or, to ``read`` it, another's that its owner
        published) and saved whole (its completion marker is there), and neither it nor its
        kind's folder is a link."""
        parts = checkpoint_parts(path, KINDS)  # NotFound, or BadRequest for a name no save makes
        run = self.runs.get(parts[0])
        if run is not None and run.tenant != tenant.id:
            published = self.notes(run).get(f"{parts[1]}/{parts[2]}", {}).get("public")
            run = run if read and published else None
        if run is None:
            raise NotFound(f"checkpoint {path!r} does not exist for this key")
        self.purge_expired(run)
        folder = self.folder(run) / parts[1] / parts[2]
        if not (real_dir(folder.parent) and real_dir(folder) and (folder / MARKER).is_file()):
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
        checkpoints that have either (``checkpoints.json`` in the run's folder); a damaged file is
        moved to ``damaged/`` and the run has no notes."""
        path = self.folder(run) / "checkpoints.json"
        if not path.exists() and not path.is_symlink():
            return {}
        try:
            if path.is_symlink() or not path.is_file():
                raise ValueError("not a regular file")
            return parse_notes(path.read_bytes())
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            quarantine(
                self.root, path, f"{path} is damaged ({why})", "it (the run's checkpoints never expire)"
            )
            return {}

    def annotate(self, run: Run, checkpoint_id: str, **values: Any) -> None:
        """Set the checkpoint's notes (a None value removes that note)."""
        with self.lock:
            notes = self.notes(run)
            entry = {**notes.get(checkpoint_id, {}), **values}
            entry = {k: v for k, v in entry.items() if v is not None}
            if entry == notes.get(checkpoint_id, {}):
                return
            if entry:
                notes[checkpoint_id] = entry
            else:
                notes.pop(checkpoint_id, None)
            atomic_write_text(self.folder(run) / "checkpoints.json", json.dumps(notes))
            fsync_dir(self.folder(run))

    def set_ttl(self, run: Run, checkpoint_id: str, ttl_seconds: float | None) -> None:
        """The checkpoint expires ``ttl_seconds`` from now (None: never)."""
        self.annotate(
            run, checkpoint_id, expires_at=None if ttl_seconds is None else time.time() + ttl_seconds
        )

    def forget(self, run: Run, checkpoint_id: str) -> None:
        """Delete the checkpoint and its notes. A link there is ``NotFound`` (it and what it points
        to stay); a checkpoint that cannot be taken away is an error and stays whole."""
        folder = self.folder(run) / checkpoint_id
        if folder.is_symlink() or folder.parent.is_symlink():
            raise NotFound(f"checkpoint {checkpoint_id} of run {run.id!r} does not exist")
        if folder.exists():
            aside = folder.with_name(f".deleting-{folder.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(folder, aside)  # out of every listing at once
            except OSError as exc:
                raise ServerError(
                    f"checkpoint {checkpoint_id} of run {run.id!r} could not be deleted ({exc.strerror}); "
                    "it is kept",
                    status=500,
                ) from None
            shutil.rmtree(aside, onerror=self._left_over)
        self.annotate(run, checkpoint_id, expires_at=None, user_metadata=None, public=None)

    @staticmethod
    def _left_over(fn: Any, path: str, exc_info: Any) -> None:
        logger.warning(f"twinkle server: {path} of a deleted checkpoint could not be removed ({exc_info[1]})")

    def purge_expired(self, run: Run) -> None:
        """Delete the run's checkpoints whose TTL has passed (checked whenever they are listed or
        looked up, and at start-up); one that cannot be deleted stays, with a warning."""
        now = time.time()
        for checkpoint_id, entry in self.notes(run).items():
            if entry.get("expires_at", now + 1) <= now:
                try:
                    self.forget(run, checkpoint_id)
                except NotFound:  # a link there: not a checkpoint, its note is stale
                    self.annotate(run, checkpoint_id, expires_at=None, user_metadata=None, public=None)
                except ServerError as exc:
                    logger.warning(f"twinkle server: expired {exc.message}")

    def checkpoints(self, run: Run) -> list[dict[str, Any]]:
        self.purge_expired(run)
        notes = self.notes(run)
        out = []
        for kind, type_ in KINDS.items():
            for folder in self._whole(run, kind):
                try:  # a folder deleted meanwhile (a park replaces its older save) is not listed
                    mtime = folder.stat().st_mtime
                    size = sum(
                        f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()
                    )
                except FileNotFoundError:
                    continue
                note = notes.get(f"{kind}/{folder.name}", {})
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{folder.name}",
                        "checkpoint_type": type_,
                        "time": mtime,
                        "tinker_path": f"tinker://{run.id}/{kind}/{folder.name}",
                        "size_bytes": size,
                        "expires_at": note.get("expires_at"),
                        "user_metadata": note.get("user_metadata"),
                        "public": bool(note.get("public")),
                    }
                )
        return out
