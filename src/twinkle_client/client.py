"""The connection a ``twinkle_client`` proxy talks through: one Tinker ``ServiceClient``."""

from typing import Any

_CURRENT: "TwinkleClient | None" = None


class TwinkleClient:
    """A ``twinkle server`` at ``base_url`` with key ``api_key``; ``MultiLoraTransformersModel``
    and ``Sampler`` build proxies bound to it."""

    def __init__(self, base_url: str, api_key: str):
        import tinker

        if not base_url.startswith(("http://", "https://")):
            base_url = f"http://{base_url}"
        self.base_url, self.api_key = base_url, api_key
        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.rest = tinker.RestClient(base_url=base_url, api_key=api_key)
        caps = self.rest.get_server_capabilities().result()
        self.base_model = caps.supported_models[0].model_name

    def MultiLoraTransformersModel(self, model_id: str | None = None, **kwargs: Any) -> Any:  # noqa: N802
        from twinkle_client.model import MultiLoraTransformersModel

        return MultiLoraTransformersModel(model_id, client=self, **kwargs)

    def Sampler(self, model_path: str | None = None) -> Any:  # noqa: N802
        from twinkle_client.sampler import Sampler

        return Sampler(model_path, client=self)


def init_twinkle_client(base_url: str, api_key: str) -> TwinkleClient:
    """Connect to the server and make this the client the proxies use by default."""
    global _CURRENT
    _CURRENT = TwinkleClient(base_url, api_key)
    return _CURRENT


def current_client(client: TwinkleClient | None = None) -> TwinkleClient:
    if client is not None:
        return client
    if _CURRENT is None:
        raise RuntimeError("call twinkle_client.init_twinkle_client(base_url, api_key) first")
    return _CURRENT
