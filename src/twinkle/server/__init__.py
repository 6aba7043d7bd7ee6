"""``twinkle server``: one base model served to many tenants, each training its own LoRA adapters
through the official Tinker SDK (``tinker.ServiceClient(base_url=..., api_key=...)``).

Public names: ``create_app`` (the FastAPI app of a ``ServerConfig``), ``ServerConfig``,
``serve`` (the command), ``launch_server(config_path=)`` (upstream's: the command with
``--config``; also ``python -m twinkle.server``). Needs the ``server`` extra (fastapi, uvicorn, tinker); ``import
twinkle`` never imports it. ``--mode ray`` (the ``ray`` extra too) puts the model and a sampler on
Ray device groups (``twinkle.server.ray_groups``). See docs/server.md."""

from twinkle.server.config import ServerConfig


def create_app(config: ServerConfig, engine=None):  # noqa: ANN001, ANN201 (fastapi is optional)
    from twinkle.server.app import create_app as make

    return make(config, engine)


def serve(argv: list[str]) -> int:
    from twinkle.server.main import serve as run

    return run(argv)


def launch_server(config_path: str | None = None, argv: list[str] | None = None) -> int:
    """Upstream's entry point: serve the YAML config at ``config_path`` (``--config``), with
    any further ``twinkle server`` flags in ``argv``."""
    return serve((["--config", str(config_path)] if config_path else []) + list(argv or []))


__all__ = ["ServerConfig", "create_app", "launch_server", "serve"]
