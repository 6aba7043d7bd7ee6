"""The registry under concurrent tenants and planted files: listings while another tenant creates
runs never fail, a checkpoint folder that is a symbolic link is never listed, loaded or deleted
(and what it points to is left alone), a checkpoint that cannot be deleted is an error, and
``max_adapters`` counts a key's parked runs as well as its live ones."""

import os
import sys
import threading
import time

import httpx
import pytest
from serving import KEY_A, KEY_B, start

from twinkle.checkpoint.layout import MARKER
from twinkle.server.errors import NotFound, ServerError
from twinkle.server.state import Limits, Registry, Tenant, tenant_id

V1 = "/api/v1"


def fake_checkpoint(folder, payload: bytes = b"weights") -> None:
    """A folder the registry counts as a whole checkpoint (its marker is there)."""
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(payload)
    (folder / MARKER).write_text("{}")


def _wait_for_a_round(rounds: list[int]) -> None:
    """Let the lister finish one more round before creating more: however fast the runs are
    created, listings run while some of them are under way."""
    seen, deadline = rounds[0], time.monotonic() + 30
    while rounds[0] == seen and time.monotonic() < deadline:
        time.sleep(0.001)


def test_listing_while_another_thread_creates_runs(tmp_path):
    """``new_run`` in a loop on one thread; ``runs_of``, ``clients_of`` and every run's checkpoints
    listed on another, with the interpreter switching threads as often as it can."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        registry = Registry(tmp_path / "srv")
        tenant = Tenant(tenant_id(KEY_A), Limits())
        done, errors, rounds = threading.Event(), [], [0]

        def create() -> None:
            try:
                for i in range(200):
                    registry.new_run(tenant, "base", 4)
                    registry.remember_client(tenant.id, f"client-{i}")
                    if i % 50 == 49:
                        _wait_for_a_round(rounds)
            except Exception as exc:  # pragma: no cover - what the test looks for
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=create).start()
        listings = 0
        while not done.is_set():
            for run in registry.runs_of(tenant.id):
                registry.checkpoints(run)
            registry.clients_of(tenant.id)
            listings += 1
            rounds[0] += 1
        assert not errors and listings > 1
        assert len(registry.runs_of(tenant.id)) == 200 and len(registry.clients_of(tenant.id)) == 200
        adapters = {r.adapter for r in registry.runs_of()}
        assert len(adapters) == 200  # the count behind each adapter name is taken under the lock
    finally:
        sys.setswitchinterval(interval)


def test_the_listing_routes_while_another_tenant_creates_runs(tiny_model_dir, tmp_path):
    """Tenants A and B list their runs and checkpoints over HTTP while B's runs are created on
    another thread (as the worker creates them): every answer is a 200, and each lists its own."""
    running = start(tiny_model_dir, tmp_path / "srv", rate=1e6)
    try:
        server = running.app.state.server
        registry, base = server.registry, server.base_model
        tenant_a, tenant_b = server.tenants[KEY_A], server.tenants[KEY_B]
        for _ in range(3):
            registry.new_run(tenant_a, base, 4)
        done, rounds = threading.Event(), [0]

        def create() -> None:
            try:
                for i in range(300):
                    registry.new_run(tenant_b, base, 4)
                    if i % 100 == 99:
                        _wait_for_a_round(rounds)
            finally:
                done.set()

        threading.Thread(target=create).start()
        codes, page = [], {"limit": 1000}
        a = httpx.Client(base_url=running.url, headers={"X-API-Key": KEY_A})
        b = httpx.Client(base_url=running.url, headers={"X-API-Key": KEY_B})
        while not done.is_set():
            for http in (b, a):
                codes.append(http.get(f"{V1}/checkpoints").status_code)
                codes.append(http.get(f"{V1}/training_runs", params=page).status_code)
            rounds[0] += 1
        assert len(codes) > 4 and set(codes) == {200}, codes
        assert len(b.get(f"{V1}/training_runs", params=page).json()["training_runs"]) == 300
        assert len(a.get(f"{V1}/training_runs", params=page).json()["training_runs"]) == 3
        a.close(), b.close()
    finally:
        running.stop()


def test_a_planted_link_is_never_listed_loaded_or_deleted(tiny_model_dir, tmp_path):
    """A link under ``weights/`` and one under ``sampler_weights/`` to whole checkpoints elsewhere,
    and a ``sampler_weights`` folder that is itself a link: none is listed, looked up or resumed
    from; DELETE is a 404 that leaves the link and its target; the real checkpoint beside them is
    listed and deleted."""
    running = start(tiny_model_dir, tmp_path / "srv", rate=1e6)
    try:
        server = running.app.state.server
        registry = server.registry
        run = registry.new_run(server.tenants[KEY_A], server.base_model, 4)
        other = registry.new_run(server.tenants[KEY_A], server.base_model, 4)
        elsewhere = tmp_path / "elsewhere"
        fake_checkpoint(elsewhere / "ckpt", b"not the server's")
        folder = registry.folder(run)
        fake_checkpoint(folder / "weights" / "real")
        os.utime(folder / "weights" / "real" / MARKER, (1, 1))  # older than the target of the link
        (folder / "weights" / "planted").symlink_to(elsewhere / "ckpt")
        (folder / "sampler_weights").mkdir()
        (folder / "sampler_weights" / "planted").symlink_to(elsewhere / "ckpt")
        (registry.folder(other) / "sampler_weights").symlink_to(elsewhere)
        assert registry.restore_point(run) == (str(folder / "weights" / "real"), True)
        assert registry.restore_point(other) == (None, True)

        http = httpx.Client(base_url=running.url, headers={"X-API-Key": KEY_A})
        listed = http.get(f"{V1}/training_runs/{run.id}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in listed] == ["weights/real"]
        assert http.get(f"{V1}/training_runs/{other.id}/checkpoints").json()["checkpoints"] == []
        everything = http.get(f"{V1}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in everything] == ["weights/real"]
        planted = [
            (run.id, "weights/planted"),
            (run.id, "sampler_weights/planted"),
            (other.id, "sampler_weights/ckpt"),
        ]
        for run_id, checkpoint_id in planted:
            path = f"tinker://{run_id}/{checkpoint_id}"
            r = http.post(f"{V1}/weights_info", json={"tinker_path": path})
            assert r.status_code == 404, (path, r.text)
            r = http.post(f"{V1}/load_weights", json={"path": path, "model_id": run_id, "optimizer": False})
            assert r.status_code == 404, (path, r.text)
            r = http.delete(f"{V1}/training_runs/{run_id}/checkpoints/{checkpoint_id}")
            assert r.status_code == 404, (path, r.text)
        assert (folder / "weights" / "planted").is_symlink()
        assert (folder / "sampler_weights" / "planted").is_symlink()
        assert (elsewhere / "ckpt" / "adapter_model.safetensors").read_bytes() == b"not the server's"
        with pytest.raises(NotFound):
            registry.forget(run, "weights/planted")
        assert (folder / "weights" / "planted").is_symlink() and (elsewhere / "ckpt" / MARKER).is_file()

        assert http.delete(f"{V1}/training_runs/{run.id}/checkpoints/weights/real").status_code == 200
        assert http.get(f"{V1}/training_runs/{run.id}/checkpoints").json()["checkpoints"] == []
        assert sorted(p.name for p in (folder / "weights").iterdir()) == ["planted"]
        http.close()
    finally:
        running.stop()


def test_a_checkpoint_that_cannot_be_deleted_is_an_error(tmp_path, monkeypatch):
    registry = Registry(tmp_path / "srv")
    run = registry.new_run(Tenant(tenant_id(KEY_A), Limits()), "base", 4)
    folder = registry.folder(run) / "weights" / "s1"
    fake_checkpoint(folder)
    registry.annotate(run, "weights/s1", user_metadata={"step": "1"})
    real_rename = os.rename

    def refuse(src, dst, *args, **kwargs):
        if str(src) == str(folder):
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(ServerError, match="could not be deleted") as refused:
        registry.forget(run, "weights/s1")
    assert refused.value.status == 500
    (listed,) = registry.checkpoints(run)  # whole, listed, its notes kept
    assert listed["checkpoint_id"] == "weights/s1" and listed["user_metadata"] == {"step": "1"}
    monkeypatch.setattr(os, "rename", real_rename)
    registry.forget(run, "weights/s1")
    assert registry.checkpoints(run) == [] and not folder.exists()


def _create(http: httpx.Client, base: str) -> httpx.Response:
    body = {"session_id": "s", "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 2}}
    return http.post(f"{V1}/create_model", json=body)


def _result(http: httpx.Client, response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = http.post(f"{V1}/retrieve_future", json={"request_id": response.json()["request_id"]})
        if r.status_code != 408:
            assert r.status_code == 200 and "error" not in r.json(), r.text
            return r.json()
    raise AssertionError("the future did not finish")


def test_max_adapters_counts_parked_runs(tiny_model_dir, tmp_path):
    """max_adapters=2: two runs, both parked (as an idle timeout or a restart leaves them); a
    third is a 429 that says so and is not retried; unloading one makes room."""
    running = start(tiny_model_dir, tmp_path / "srv", keys={KEY_A: Limits(max_adapters=2, rate=1e6)})
    try:
        server = running.app.state.server
        http = httpx.Client(base_url=running.url, headers={"X-API-Key": KEY_A}, timeout=30)
        base = server.base_model
        ids = [_result(http, _create(http, base))["model_id"] for _ in range(2)]
        server.queue.call(lambda: [server.park(r, force=True) for r in server.registry.runs_of()])
        assert all(not server.registry.runs[i].live and server.registry.runs[i].parked for i in ids)

        refused = _create(http, base)
        assert refused.status_code == 429 and refused.headers["x-should-retry"] == "false"
        detail = refused.json()["detail"]
        assert "0 live and 2 parked" in detail and "max_adapters" in detail and "unload" in detail

        unload = http.post(f"{V1}/unload_model", json={"model_id": ids[0]})
        _result(http, unload)
        third = _result(http, _create(http, base))["model_id"]
        assert third not in ids and server.registry.runs[third].live
        refused = _create(http, base)
        assert refused.status_code == 429 and "1 live and 1 parked" in refused.json()["detail"]
        http.close()
    finally:
        running.stop()
