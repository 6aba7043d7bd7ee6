"""``twinkle server --report-to wandb`` and ``swanlab``: each training run's records reach the
library's offline files, read back here: one wandb run per training run, in the run's folder;
one swanlab experiment for the server, each run's numbers under ``<run id>/``. Skipped only when
the library is not installed."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import tinker
from serving import KEY_A, KEY_B, start
from test_server import ROWS, datum
from tinker import types

from twinkle.server.config import parse_args
from twinkle.utils.errors import UserError

OPS = ("forward_backward", "optim_step")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Both libraries offline, their own files (settings, caches, logs) inside ``tmp_path``."""
    for name in ("WANDB_API_KEY", "SWANLAB_API_KEY", "WANDB_PROJECT", "SWANLAB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "SWANLAB_SAVE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "libraries" / name.lower()))


def log_records(path: Path) -> list[bytes]:
    """The records of a wandb (``.wandb``) or swanlab (``.swanlab``) offline file: both are
    LevelDB logs (a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header:
    checksum, length, type full/first/middle/last) of protobuf messages."""
    raw = path.read_bytes()
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # too little left in the block for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(pending)
            pending = b""
    return records


def train_two_tenants(url: str, base: str) -> list[str]:
    """Tenant A: two steps; tenant B: one step. Their run ids."""
    ids = []
    for key, steps in ((KEY_A, 2), (KEY_B, 1)):
        tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model=base, rank=4, train_unembed=False
        )
        tc = tc.result()
        for _ in range(steps):
            tc.forward_backward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        ids.append(tc.model_id)
    return ids


def expected_numbers(folder: Path) -> dict[str, list[float]]:
    """``<op>/<name>`` -> the values of the run's ``metrics.jsonl``, in order."""
    out: dict[str, list[float]] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name not in ("op", "time") and isinstance(value, int | float):
                out.setdefault(f"{record['op']}/{name}", []).append(float(value))
    return out


def test_wandb_gets_one_run_per_training_run(tiny_model_dir, tmp_path, offline):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    running = start(tiny_model_dir, tmp_path / "srv", report_to=("wandb",))
    try:
        run_ids = train_two_tenants(running.url, str(tiny_model_dir))
        registry = running.app.state.server.registry
        folders = [registry.folder(registry.runs[r]) for r in run_ids]
    finally:
        running.stop()  # finishes the wandb runs
    for run_id, folder, steps in zip(run_ids, folders, (2, 1), strict=True):
        (path,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")  # one wandb run in the run's folder
        logged: dict[str, list[float]] = {}
        names = []
        for raw in log_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.HasField("run"):
                names.append(record.run.display_name)
            for item in record.history.item if record.HasField("history") else ():
                key = item.key or "/".join(item.nested_key)  # wandb fills one or the other
                if not key.startswith("_"):
                    logged.setdefault(key, []).append(json.loads(item.value_json))
        assert names == [run_id]
        for op in OPS:  # each op against its own count
            assert logged.pop(f"{op}/step") == list(range(1, steps + 1))
        expected = expected_numbers(folder)
        assert logged.keys() == expected.keys()
        for key, values in expected.items():
            np.testing.assert_allclose(logged[key], values, rtol=1e-6, err_msg=key)
        assert len(expected["forward_backward/loss:sum"]) == steps


def test_swanlab_gets_each_run_under_its_id(tiny_model_dir, tmp_path, offline):
    pytest.importorskip("swanlab")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    running = start(tiny_model_dir, tmp_path / "srv", report_to=("swanlab", "tensorboard"))
    try:
        run_ids = train_two_tenants(running.url, str(tiny_model_dir))
        registry = running.app.state.server.registry
        folders = [registry.folder(registry.runs[r]) for r in run_ids]
    finally:
        running.stop()  # finishes the experiment
    (path,) = (tmp_path / "srv" / "swanlab").glob("run-*/*.swanlab")  # one experiment for the server
    logged: dict[str, list[tuple[int, float]]] = {}
    for raw in log_records(path):
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            logged.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
    expected = {
        f"{run_id}/{key}": values
        for run_id, folder in zip(run_ids, folders, strict=True)
        for key, values in expected_numbers(folder).items()
    }
    assert logged.keys() == expected.keys()
    for key, values in expected.items():
        assert [step for step, _ in logged[key]] == list(range(1, len(values) + 1))
        np.testing.assert_allclose([v for _, v in logged[key]], values, rtol=1e-6, err_msg=key)
    for folder in folders:  # tensorboard beside it, per run
        assert list((folder / "tensorboard").glob("events.out.tfevents.*"))


def test_report_to_takes_a_comma_list_and_a_missing_library_is_one_line(monkeypatch):
    from twinkle.metric import sinks

    monkeypatch.setenv("TWINKLE_API_KEYS", "tml-a")
    real = sinks.importlib.util.find_spec
    monkeypatch.setattr(
        sinks.importlib.util, "find_spec", lambda n: object() if n in ("wandb", "swanlab") else real(n)
    )
    assert parse_args(["--report-to", "tensorboard,wandb, swanlab"]).report_to == (
        "tensorboard",
        "wandb",
        "swanlab",
    )
    assert parse_args([]).report_to == ()
    with pytest.raises(UserError, match="unknown mlflow; valid names: none, tensorboard, wandb, swanlab"):
        parse_args(["--report-to", "mlflow"])
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(UserError) as err:
        parse_args(["--report-to", "wandb"])
    assert "\n" not in str(err.value) and "pip install 'twinkle[wandb]'" in str(err.value)
