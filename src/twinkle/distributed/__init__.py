"""Distributed building blocks: ``DeviceMesh`` (sizes of the data-parallel and FSDP dimensions)
and ``DeviceGroup`` (a named set of ranks and their device type)."""

from twinkle.distributed.device_group import DeviceGroup
from twinkle.distributed.mesh import DeviceMesh

__all__ = ["DeviceGroup", "DeviceMesh"]
