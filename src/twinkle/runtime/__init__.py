"""The process runtime: ``initialize``, ``get_runtime``, ``get_device_placement``, ``shutdown``.

``initialize()`` is the one place that touches process-wide state: seeds, the device, and the
process group when torchrun started several processes."""

from twinkle.runtime.runtime import Runtime, get_device_placement, get_runtime, initialize, shutdown

__all__ = ["Runtime", "initialize", "get_runtime", "get_device_placement", "shutdown"]
