"""Upstream's ``server_config.yaml`` as ``twinkle server`` flags (``--config FILE``).

Upstream deploys Ray Serve applications (``server``, ``model``, ``sampler``, ``processor``);
this server is one process with one model. Each key is read one of three ways:

- honoured: it becomes a flag (``http_options.host/port``, the model's ``model_id``,
  ``server_config.per_token_model_limit`` -> ``--max-adapters``, ``queue_config.rps_limit`` ->
  ``--rate``, ``adapter_config.adapter_timeout`` -> ``--idle-timeout``);
- satisfied: it asks for what this server does anyway (the ``transformers`` backend, one
  replica, one rank, ``persistence.mode: file``, telemetry off), so it is accepted;
- deployment plumbing of Ray Serve (``route_prefix``, ``import_path``, ``ray_actor_options``,
  ...): ``INERT``, named once in a warning line, never silently.

Anything else, or a value this server cannot give (``backend: megatron``, ``persistence.mode:
redis``, autoscaling past one replica, telemetry on), is one ``UserError`` line naming the key."""

from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError

INERT = {
    "proxy_location",
    "route_prefix",
    "import_path",
    "name",
    "ray_actor_options",
    "max_ongoing_requests",
    "nproc_per_node",
    "ncpu_proc_per_node",
    "engine_args",
    "sampler_type",
    "max_length",
    "tps_limit",
    "otlp_endpoint",
    "file_path",
    "device_type",
    "target_ongoing_requests",
}


def _refuse(where: str, what: str) -> None:
    raise UserError(f"--config: {where}: {what}")


def _walk_inert(data: dict, where: str, inert: list[str], allowed: dict[str, Any]) -> None:
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key in allowed:
            allowed[key](value, path)
        elif key in INERT:
            inert.append(path)
        else:
            _refuse(path, "not a key this server reads")


def read_config(path: str) -> tuple[list[str], list[str]]:
    """(flags, the inert keys' paths) of the YAML file at ``path``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--config {path}: cannot read it ({exc})") from None
    flags: dict[str, str] = {}
    inert: list[str] = []

    def http(v: dict, p: str) -> None:
        for k, x in v.items():
            if k not in ("host", "port"):
                _refuse(f"{p}.{k}", "not a key this server reads")
            flags[f"--{k}"] = str(x)

    def telemetry(v: dict, p: str) -> None:
        if v.get("enabled"):
            _refuse(f"{p}.enabled", "telemetry export is not supported (GET /metrics serves Prometheus text)")
        _walk_inert({k: x for k, x in v.items() if k != "enabled"}, p, inert, {})

    def persistence(v: dict, p: str) -> None:
        if v.get("mode", "file") != "file":
            _refuse(
                f"{p}.mode",
                f"{v.get('mode')!r} persistence is not supported; the server keeps its state in files under --output-dir",
            )
        _walk_inert({k: x for k, x in v.items() if k != "mode"}, p, inert, {})

    def apps(v: list, p: str) -> None:
        for i, app in enumerate(v):
            _application(app, f"{p}[{i}]", flags, inert)

    _walk_inert(
        data,
        "",
        inert,
        {"http_options": http, "telemetry": telemetry, "persistence": persistence, "applications": apps},
    )
    return [x for k, v in flags.items() for x in (k, v)], inert


def _application(app: dict, where: str, flags: dict[str, str], inert: list[str]) -> None:
    def args(v: dict, p: str) -> None:
        allowed = {
            "model_id": lambda x, q: _model(x, q, flags),
            "supported_models": lambda x, q: [_model(m, q, flags) for m in x],
            "backend": lambda x, q: (
                x == "transformers" or _refuse(q, f"the {x!r} backend is not supported; use transformers")
            ),
            "server_config": lambda x, q: _server_config(x, q, flags),
            "queue_config": lambda x, q: _walk_inert(
                x, q, inert, {"rps_limit": lambda r, _: flags.__setitem__("--rate", str(r))}
            ),
            "adapter_config": lambda x, q: _walk_inert(
                x, q, inert, {"adapter_timeout": lambda t, _: flags.__setitem__("--idle-timeout", str(t))}
            ),
            "device_group": lambda x, q: _one(x, q, "ranks", inert),
            "device_mesh": lambda x, q: _one(x, q, "dp_size", inert),
        }
        _walk_inert(v, p, inert, allowed)

    def deployments(v: list, p: str) -> None:
        for i, d in enumerate(v):
            scale = {"autoscaling_config": lambda x, q: _replicas(x, q, inert)}
            _walk_inert(d, f"{p}[{i}]", inert, scale)

    _walk_inert(app, where, inert, {"args": args, "deployments": deployments})


def _model(model_id: str, where: str, flags: dict[str, str]) -> None:
    given = flags.get("--model-id")
    if given is not None and given.split("://")[-1] != str(model_id).split("://")[-1]:
        _refuse(where, f"a second model {model_id!r}; this server serves one ({given!r})")
    if given is None or "://" in str(model_id):
        flags["--model-id"] = str(model_id)


def _server_config(v: dict, where: str, flags: dict[str, str]) -> None:
    for k, x in v.items():
        if k != "per_token_model_limit":
            _refuse(f"{where}.{k}", "not a key this server reads")
        flags["--max-adapters"] = str(x)


def _one(v: dict, where: str, key: str, inert: list[str]) -> None:
    if int(v.get(key, 1)) != 1:
        _refuse(
            f"{where}.{key}", f"{v[key]} ranks need --mode ray (--model-ranks/--sampler-ranks), not --config"
        )
    _walk_inert({k: x for k, x in v.items() if k != key}, where, inert, {})


def _replicas(v: dict, where: str, inert: list[str]) -> None:
    for k in ("min_replicas", "max_replicas"):
        if int(v.get(k, 1)) != 1:
            _refuse(f"{where}.{k}", "autoscaling past one replica is not supported")
    _walk_inert({k: x for k, x in v.items() if k not in ("min_replicas", "max_replicas")}, where, inert, {})
