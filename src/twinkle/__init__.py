"""Twinkle: fine-tune LLMs with an explicit training loop.

Public names: ``initialize``, ``DeviceMesh``, ``DeviceGroup``, ``Platform``,
``get_device_placement``, ``get_logger``; ``init_twinkle_client`` and ``init_tinker_client``
(upstream's entry points to a ``twinkle server``; ``twinkle_client`` is imported only when one
is called, so ``import twinkle`` stays free of the client and the Tinker SDK)."""

from typing import Any

from twinkle.distributed import DeviceGroup, DeviceMesh
from twinkle.runtime import get_device_placement, initialize
from twinkle.utils.logger import get_logger
from twinkle.utils.platform import Platform


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None) -> Any:
    """``twinkle_client.init_twinkle_client``: connect to a ``twinkle server``."""
    from twinkle_client import init_twinkle_client as connect

    return connect(base_url=base_url, api_key=api_key)


def init_tinker_client() -> None:
    """``twinkle_client.init_tinker_client``: the Tinker SDK then talks to a ``twinkle server``."""
    from twinkle_client import init_tinker_client as ready

    ready()


__all__ = [
    "init_twinkle_client",
    "init_tinker_client",
    "DeviceMesh",
    "DeviceGroup",
    "Platform",
    "initialize",
    "get_device_placement",
    "get_logger",
]
__version__ = "0.1.0"
