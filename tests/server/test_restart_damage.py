"""A restart always comes back: a damaged record of the registry (what a kill during its write, a
full disk or a hand edit leaves) is moved under ``output_dir/damaged/`` with one warning, and every
other tenant and run is served; nothing is deleted. A server that cannot start is one ``error:``
line."""

import json
import logging
from pathlib import Path

import httpx
import pytest
import tinker
from serving import KEY_A, KEY_B, free_port, start
from tinker import types

from twinkle.checkpoint.layout import MARKER
from twinkle.server.state import Limits, Registry, Tenant, tenant_id

TA, TB = tenant_id(KEY_A), tenant_id(KEY_B)
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1, 1, 1]},
)


@pytest.fixture
def warnings(caplog):
    """The server's warnings (the ``twinkle`` logger does not propagate to the root logger)."""
    logger = logging.getLogger("twinkle")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="twinkle")
    yield lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("twinkle server:")]
    logger.removeHandler(caplog.handler)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_nothing_lost(before: dict[str, bytes], root: Path) -> None:
    """Every file of ``before`` is where it was or at the same path under ``damaged/``; a
    ``.jsonl``'s lines are split between the two."""
    for rel, data in before.items():
        here, there = root / rel, root / "damaged" / rel
        if rel.endswith(".jsonl"):
            kept = [p.read_bytes().splitlines() for p in (here, there) if p.is_file()]
            assert sorted(sum(kept, [])) == sorted(data.splitlines()), rel
        else:
            assert (here.is_file() and here.read_bytes() == data) or there.read_bytes() == data, rel


def empty_run_json(run: Path) -> Path:
    (run / "run.json").write_bytes(b"")  # a kill between open() and write()
    return run / "run.json"


def list_run_json(run: Path) -> Path:
    (run / "run.json").write_text("[]")
    return run / "run.json"


def torn_clients_line(run: Path) -> Path:
    with open(run.parent / "clients.jsonl", "a") as f:
        f.write('{"id": "3f2a9')  # a kill during the append
    return run.parent / "clients.jsonl"


def bad_checkpoints_json(run: Path) -> Path:
    (run / "checkpoints.json").write_text('{"weights/a1": {"expires_at": "soon"}}')
    return run / "checkpoints.json"


@pytest.mark.parametrize(
    "damage",
    [empty_run_json, list_run_json, torn_clients_line, bad_checkpoints_json],
    ids=lambda f: f.__name__,
)
def test_a_damaged_record_is_moved_aside_and_every_other_run_comes_back(
    damage, tiny_model_dir, tmp_path, warnings
):
    """Tenants A and B each save a run; the server stops and one of A's records is damaged. The
    restarted server warns once naming it, has moved it under ``damaged/`` (nothing lost), and
    B's run (and A's, where its run.json is whole) trains on through the same SDK objects."""
    out, port = tmp_path / "srv", free_port()
    running = start(tiny_model_dir, out, port=port)
    try:
        trainers = {}
        for key in (KEY_A, KEY_B):
            client = tinker.ServiceClient(base_url=running.url, api_key=key)
            trainers[key] = client.create_lora_training_client(
                base_model=str(tiny_model_dir), rank=4, train_unembed=False
            ).result()
            trainers[key].save_state("s1").result()
    finally:
        running.stop()
    run_a = out / TA / trainers[KEY_A].model_id
    client_a = json.loads((out / TA / "clients.jsonl").read_text().splitlines()[0])["id"]
    damaged = damage(run_a)
    before = files(out)

    running = start(tiny_model_dir, out, port=port)
    try:
        said = warnings()
        assert len(said) == 1 and str(damaged) in said[0] and "damaged" in said[0], said
        moved = out / "damaged" / damaged.relative_to(out)
        assert moved.is_file() and str(out / "damaged" / TA) in said[0]
        assert_nothing_lost(before, out)
        runs = running.app.state.server.registry.runs
        alive = [KEY_B] if damaged.name == "run.json" else [KEY_A, KEY_B]
        if damaged.name == "run.json":  # the whole run folder, its checkpoint with it
            assert trainers[KEY_A].model_id not in runs and not run_a.exists()
            assert (out / "damaged" / TA / run_a.name / "weights" / "s1" / MARKER).is_file()
        for key in alive:
            assert trainers[key].forward_backward([DATUM], "cross_entropy").result().metrics["loss:sum"] > 0
            assert runs[trainers[key].model_id].live  # resumed from s1
        r = httpx.get(f"{running.url}/api/v1/sessions/{client_a}", headers={"X-API-Key": KEY_A})
        assert r.status_code == 200  # A's client is known in every case
        if damaged.name == "checkpoints.json":  # its checkpoint stays, with no TTL
            rest = tinker.RestClient(base_url=running.url, api_key=KEY_A)
            (ckpt,) = rest.list_checkpoints(trainers[KEY_A].model_id).result().checkpoints
            assert ckpt.checkpoint_id == "weights/s1" and ckpt.expires_at is None
    finally:
        running.stop()
    Registry(out)
    assert len(warnings()) == 1, "a second start reads damaged/ back"


def test_every_kind_of_damaged_record_is_quarantined_once(tmp_path, warnings):
    """Without a model: run.json not UTF-8, a field missing or of the wrong type, an id that is
    not its folder's; a bad line in the middle of samplers.jsonl, a line holding a list in
    clients.jsonl. Each is moved with one warning naming it; the good records come back; a second
    start warns about nothing and reads the same."""
    root = tmp_path / "srv"
    registry = Registry(root)
    a, b = Tenant(TA, Limits()), Tenant(TB, Limits())
    runs = {name: registry.new_run(a, "base", 4) for name in ("utf8", "missing", "typed", "moved", "good")}
    good_b = registry.new_run(b, "base", 2)
    for i in range(3):
        registry.remember_client(TA, f"client-{i}")
        registry.remember_sampler(TB, f"sampler-{i}", f"tinker://{good_b.id}/sampler_weights/w{i}")
    folder = {k: registry.folder(r) for k, r in runs.items()}
    (folder["utf8"] / "run.json").write_bytes(b'{"id": "\xff\xfe"}')
    meta = json.loads((folder["missing"] / "run.json").read_text())
    (folder["missing"] / "run.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "rank"}))
    meta = json.loads((folder["typed"] / "run.json").read_text())
    (folder["typed"] / "run.json").write_text(json.dumps({**meta, "rank": "4"}))
    (folder["moved"] / "run.json").write_text((folder["good"] / "run.json").read_text())  # another's id
    lines = (root / TB / "samplers.jsonl").read_text().splitlines()
    (root / TB / "samplers.jsonl").write_text(
        "\n".join([lines[0], '{"id": 7, "path": null}', *lines[1:]]) + "\n"
    )
    with open(root / TA / "clients.jsonl", "a") as f:
        f.write('["client-9"]\n')
    before = files(root)

    again = Registry(root)
    said = warnings()
    damaged = [folder[k] / "run.json" for k in ("utf8", "missing", "typed", "moved")]
    damaged += [root / TA / "clients.jsonl", root / TB / "samplers.jsonl"]
    assert len(said) == len(damaged), said
    for path in damaged:
        assert sum(str(path) in line for line in said) == 1, (path, said)
    assert set(again.runs) == {runs["good"].id, good_b.id}
    assert again.clients == {f"client-{i}": TA for i in range(3)}
    assert set(again.samplers) == {f"sampler-{i}" for i in range(3)}
    assert_nothing_lost(before, root)
    assert (root / "damaged" / TB / "samplers.jsonl").read_text() == '{"id": 7, "path": null}\n'
    why = {
        k: next(line for line in said if str(folder[k]) in line)
        for k in ("utf8", "missing", "typed", "moved")
    }
    assert "not UTF-8" in why["utf8"] and "not its folder's" in why["moved"]
    assert "field 'rank' is missing or not int" in why["missing"] and "field 'rank'" in why["typed"]

    third = Registry(root)  # damaged/ is never read as a tenant folder, the .jsonl were rewritten
    assert len(warnings()) == len(damaged)
    assert set(third.runs) == set(again.runs) and third.clients == again.clients


def test_a_line_after_a_torn_one_starts_a_line_of_its_own(tmp_path, warnings):
    """A kill during an append leaves no newline; the next append (by a server that did not restart
    in between) is a whole line: at the restart only the torn line is moved aside."""
    root = tmp_path / "srv"
    registry = Registry(root)
    registry.remember_client(TA, "first")
    with open(root / TA / "clients.jsonl", "a") as f:
        f.write('{"id": "tor')
    registry.remember_client(TA, "second")
    assert Registry(root).clients == {"first": TA, "second": TA}
    assert (root / "damaged" / TA / "clients.jsonl").read_text() == '{"id": "tor\n'
    assert len(warnings()) == 1


def test_the_registry_writes_its_files_whole(tmp_path, monkeypatch):
    """run.json and checkpoints.json go through a flushed temporary file renamed into place (a
    failure while writing leaves the old file, no temporary); each .jsonl line is flushed to disk."""
    import os

    root = tmp_path / "srv"
    registry = Registry(root)
    run = registry.new_run(Tenant(TA, Limits()), "base", 4)
    registry.annotate(run, "weights/s1", user_metadata={"step": "1"})
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    registry.remember_client(TA, "c1")
    assert synced, "the appended line was not flushed to disk"
    notes = (registry.folder(run) / "checkpoints.json").read_text()

    def torn_write(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", torn_write)
    with pytest.raises(OSError, match="No space"):
        registry.annotate(run, "weights/s1", user_metadata={"step": "2"})
    assert (registry.folder(run) / "checkpoints.json").read_text() == notes
    assert sorted(p.name for p in registry.folder(run).iterdir()) == ["checkpoints.json", "run.json"]


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_output_dir_is_one_error_line(kind, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from twinkle.cli.main import main

    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker if kind == "a file" else blocker / "srv"
    monkeypatch.setenv("TWINKLE_API_KEYS", KEY_A)
    argv = ["server", "--model-id", str(tiny_model_dir), "--output-dir", str(out), "--port", str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --output-dir {out} is not ") and blocker.read_text() == "not a folder"


def test_a_tenant_folder_that_cannot_be_read_keeps_only_its_runs_out(tmp_path, monkeypatch, warnings):
    root = tmp_path / "srv"
    registry = Registry(root)
    registry.new_run(Tenant(TA, Limits()), "base", 4)
    run_b = registry.new_run(Tenant(TB, Limits()), "base", 4)
    real_iterdir = Path.iterdir

    def iterdir(self):
        if self == root / TA:
            raise PermissionError(13, "Permission denied")
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert set(Registry(root).runs) == {run_b.id}
    (said,) = warnings()
    assert str(root / TA) in said and "Permission denied" in said
    assert (root / TA).is_dir()  # left as it is
