"""``TwinkleClient``: the connection to a ``twinkle server`` (``connection``) that builds the
proxies bound to it, and ``init_twinkle_client``, which makes it the proxies' default."""

from typing import Any

from twinkle_client import model, sampler
from twinkle_client.connection import Connection, set_current


class TwinkleClient(Connection):
    """A ``twinkle server`` at ``base_url`` with key ``api_key``; ``MultiLoraTransformersModel``
    and ``Sampler`` build proxies bound to it."""

    def MultiLoraTransformersModel(self, model_id: str | None = None, **kwargs: Any) -> Any:  # noqa: N802
        return model.MultiLoraTransformersModel(model_id, client=self, **kwargs)

    def Sampler(self, model_path: str | None = None) -> Any:  # noqa: N802
        return sampler.Sampler(model_path, client=self)


def init_twinkle_client(base_url: str, api_key: str) -> TwinkleClient:
    """Connect to the server and make this the client the proxies use by default."""
    client = TwinkleClient(base_url, api_key)
    set_current(client)
    return client
