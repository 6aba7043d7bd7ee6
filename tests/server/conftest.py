"""The ``server`` fixture: a ``twinkle server`` serving the tiny model to keys A and B."""

import pytest
import torch
from serving import start


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    running = start(tiny_model_dir, tmp_path / "srv")
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _no_sdk_telemetry(monkeypatch):
    """The SDK reports its own events to the server it talks to; a test's server is gone by the
    time the SDK flushes them at exit."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
