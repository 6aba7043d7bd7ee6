"""The connection a ``twinkle_client`` proxy talks through (one Tinker ``ServiceClient`` and its
``RestClient``), and the current one: the connection a proxy built without ``client=`` uses.

``base_url`` and ``api_key`` left out are read from ``TWINKLE_SERVER_URL`` and
``TWINKLE_SERVER_TOKEN``, as upstream's client reads them; any key is sent as it is
(``tinker_patch``), so a server started without keys takes upstream's default ``EMPTY_TOKEN``."""

import os
from typing import Any

from twinkle_client.tinker_patch import as_tinker_path, patch_tinker

_CURRENT: "Connection | None" = None


class Connection:
    """A ``twinkle server`` at ``base_url`` with key ``api_key``, and the base model it serves."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None):
        patch_tinker()
        import tinker

        base_url = base_url or os.environ.get("TWINKLE_SERVER_URL") or "http://127.0.0.1:8000"
        api_key = api_key or os.environ.get("TWINKLE_SERVER_TOKEN") or "EMPTY_TOKEN"
        if not base_url.startswith(("http://", "https://")):
            base_url = f"http://{base_url}"
        self.base_url, self.api_key = base_url, api_key
        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.rest = tinker.RestClient(base_url=base_url, api_key=api_key)
        self.base_model = self.get_server_capabilities().supported_models[0].model_name

    def get_server_capabilities(self) -> Any:
        """The served base model(s) (``supported_models[i].model_name``)."""
        return self.rest.get_server_capabilities().result()

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[Any]:
        """This key's training runs (``training_run_id``, ``base_model``, ``lora_rank``, ...)."""
        return list(self.rest.list_training_runs(limit=limit, offset=offset).result().training_runs)

    def list_checkpoints(self, training_run_id: str | None = None) -> list[Any]:
        """The checkpoints of one run, or of every run of this key (``tinker_path``,
        ``checkpoint_type``, ``user_metadata``, ...)."""
        if training_run_id is None:
            return list(self.rest.list_user_checkpoints().result().checkpoints)
        return list(self.rest.list_checkpoints(training_run_id).result().checkpoints)

    def publish_checkpoint(self, path: str) -> None:
        self.rest.publish_checkpoint_from_tinker_path(as_tinker_path(path)).result()


def set_current(connection: Connection) -> None:
    """Make ``connection`` the one the proxies use by default."""
    global _CURRENT
    _CURRENT = connection


def current_client(client: Connection | None = None) -> Connection:
    if client is not None:
        return client
    if _CURRENT is None:
        raise RuntimeError("call twinkle_client.init_twinkle_client(base_url, api_key) first")
    return _CURRENT
