"""Distributed building blocks: ``DeviceMesh`` (sizes of the data-parallel and FSDP dimensions)."""

from twinkle.distributed.mesh import DeviceMesh

__all__ = ["DeviceMesh"]
