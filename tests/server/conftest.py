"""The ``server`` fixture: a ``twinkle server`` serving the tiny model to keys A and B."""

import pytest
import torch
from sdk_sessions import closing_module_clients
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


@pytest.fixture(scope="module", autouse=True)
def _sdk_clients_closed():
    """Every SDK client the module made is closed after its last test: no session heartbeat
    outlives its server (``sdk_sessions``)."""
    yield from closing_module_clients()
