"""Twinkle: fine-tune LLMs with an explicit training loop.

Public names: ``initialize``, ``DeviceMesh``, ``get_device_placement``, ``get_logger``."""

from twinkle.distributed import DeviceMesh
from twinkle.runtime import get_device_placement, initialize
from twinkle.utils.logger import get_logger

__all__ = ["DeviceMesh", "initialize", "get_device_placement", "get_logger"]
__version__ = "0.1.0"
