"""The process runtime: ``initialize``, ``get_runtime``, ``get_device_placement``, ``shutdown``,
and the run defaults (``RunDefaults``, ``set_run_defaults``, ``run_defaults``).

``initialize()`` is the one place that touches process-wide state: seeds, the device, the
process group when torchrun started several processes, and the lock on the run's output dir
(``output_lock``)."""

from twinkle.runtime.runtime import (
    RunDefaults,
    Runtime,
    get_device_placement,
    get_runtime,
    initialize,
    run_defaults,
    set_run_defaults,
    shutdown,
)

__all__ = [
    "Runtime",
    "RunDefaults",
    "initialize",
    "get_runtime",
    "get_device_placement",
    "run_defaults",
    "set_run_defaults",
    "shutdown",
]
