"""``TwinkleClient``: the connection to a ``twinkle server`` (``connection``) that builds the
proxies bound to it; ``init_twinkle_client``, which makes it the proxies' default; and
``init_tinker_client``, which readies the Tinker SDK for a ``twinkle server``."""

from typing import Any

from twinkle_client import model, sampler
from twinkle_client.connection import Connection, set_current
from twinkle_client.tinker_patch import patch_tinker


class TwinkleClient(Connection):
    """A ``twinkle server`` at ``base_url`` with key ``api_key``; ``MultiLoraTransformersModel``,
    ``Sampler`` and ``vLLMSampler`` build proxies bound to it."""

    def MultiLoraTransformersModel(self, model_id: str | None = None) -> Any:  # noqa: N802
        return model.MultiLoraTransformersModel(model_id, client=self)

    def Sampler(self, model_path: str | None = None) -> Any:  # noqa: N802
        return sampler.Sampler(model_path, client=self)

    def vLLMSampler(self, model_id: str | None = None) -> Any:  # noqa: N802
        return sampler.vLLMSampler(model_id, client=self)


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None) -> TwinkleClient:
    """Connect to the server and make this the client the proxies use by default
    (``base_url``/``api_key`` default to ``$TWINKLE_SERVER_URL``/``$TWINKLE_SERVER_TOKEN``)."""
    client = TwinkleClient(base_url, api_key)
    set_current(client)
    return client


def init_tinker_client() -> None:
    """After it, ``tinker.ServiceClient(base_url=..., api_key=...)`` takes any key the server
    accepts (the SDK itself sends only ``tml-`` keys) and ``twinkle://`` checkpoint paths, and its
    ``create_lora_training_client`` defaults to ``train_unembed=False`` (the server's LoRA is never
    on the unembedding, and it refuses True by name)."""
    patch_tinker()
