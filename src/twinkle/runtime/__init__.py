"""The process runtime: ``initialize``, ``get_runtime``, ``get_device_placement``, ``shutdown``,
and the run's configuration (``RunDefaults``, ``run_defaults``, ``hand_over``).

``initialize()`` is the one place that touches process-wide state: seeds, the device, the
process group when torchrun started several processes, the lock on the run's output dir
(``output_lock``), the SIGTERM handler and the one-line error hook; the configuration it
applies comes from ``initialize(run=...)`` or from the CLI (``twinkle.cli``) (``hand_over``)."""

from twinkle.runtime.run_config import RunDefaults, hand_over
from twinkle.runtime.runtime import (
    Runtime,
    get_device_placement,
    get_runtime,
    initialize,
    run_defaults,
    shutdown,
)

__all__ = [
    "Runtime",
    "RunDefaults",
    "initialize",
    "get_runtime",
    "get_device_placement",
    "run_defaults",
    "hand_over",
    "shutdown",
]
