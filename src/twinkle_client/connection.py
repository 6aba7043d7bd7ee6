"""The connection a ``twinkle_client`` proxy talks through (one Tinker ``ServiceClient``), and the
current one: the connection a proxy built without ``client=`` uses."""

_CURRENT: "Connection | None" = None


class Connection:
    """A ``twinkle server`` at ``base_url`` with key ``api_key``, and the base model it serves."""

    def __init__(self, base_url: str, api_key: str):
        import tinker

        if not base_url.startswith(("http://", "https://")):
            base_url = f"http://{base_url}"
        self.base_url, self.api_key = base_url, api_key
        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.rest = tinker.RestClient(base_url=base_url, api_key=api_key)
        caps = self.rest.get_server_capabilities().result()
        self.base_model = caps.supported_models[0].model_name


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
