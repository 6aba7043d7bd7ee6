"""Twinkle: fine-tune LLMs with an explicit training loop.

Public names: ``initialize``, ``DeviceMesh``, ``DeviceGroup``, ``Platform``,
``get_device_placement``, ``get_logger``."""

from twinkle.distributed import DeviceGroup, DeviceMesh
from twinkle.runtime import get_device_placement, initialize
from twinkle.utils.logger import get_logger
from twinkle.utils.platform import Platform

__all__ = ["DeviceMesh", "DeviceGroup", "Platform", "initialize", "get_device_placement", "get_logger"]
__version__ = "0.1.0"
