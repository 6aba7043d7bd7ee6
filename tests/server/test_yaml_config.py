"""``twinkle server --config``: upstream's server_config.yaml keys read, satisfied, named as
inert, or refused in one line naming the key."""

import pytest

from twinkle.server.config import parse_args
from twinkle.utils.errors import UserError

CONFIG = """
proxy_location: EveryNode
http_options: {host: 127.0.0.1, port: 8123}
telemetry: {enabled: false, otlp_endpoint: "http://localhost:4317"}
persistence: {mode: file, file_path: /tmp/state.json}
applications:
  - name: server
    route_prefix: /api/v1
    import_path: server
    args:
      server_config: {per_token_model_limit: 3}
      supported_models: [Org/Tiny]
    deployments:
      - name: TinkerCompatServer
        autoscaling_config: {min_replicas: 1, max_replicas: 1, target_ongoing_requests: 128}
  - name: models-Tiny
    import_path: model
    args:
      backend: transformers
      model_id: "ms://Org/Tiny"
      device_group: {name: model, ranks: 1, device_type: cuda}
      queue_config: {rps_limit: 7, tps_limit: 100000}
      adapter_config: {adapter_timeout: 30}
"""


def _write(tmp_path, text):
    path = tmp_path / "server_config.yaml"
    path.write_text(text)
    return str(path)


def test_upstream_keys_become_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TWINKLE_API_KEYS", raising=False)
    config = parse_args(["--config", _write(tmp_path, CONFIG), "--max-loras", "2"])
    assert (config.host, config.port, config.model_id) == ("127.0.0.1", 8123, "ms://Org/Tiny")
    limits = next(iter(config.keys.values()))
    assert (limits.max_adapters, limits.rate, config.idle_timeout, config.max_loras) == (3, 7.0, 30.0, 2)
    assert "proxy_location" in capsys.readouterr().out  # an inert key is named, not dropped silently


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("backend: transformers", "backend: megatron", "args.backend: the 'megatron' backend"),
        ("mode: file", "mode: redis", "persistence.mode: 'redis' persistence"),
        ("max_replicas: 1", "max_replicas: 4", "autoscaling_config.max_replicas"),
        ("rps_limit: 7", "rps_limit: 7, burst: 2", "queue_config.burst: not a key"),
    ],
)
def test_unsupported_keys_are_one_line_naming_them(tmp_path, old, new, named):
    with pytest.raises(UserError, match=named.replace("(", r"\(")) as err:
        parse_args(["--config", _write(tmp_path, CONFIG.replace(old, new))])
    assert "\n" not in str(err.value)
