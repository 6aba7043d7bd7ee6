"""Kernel replacement for model modules: ops x backends, tried in order, falling through.

Public names: ``kernelize``, ``KernelChoice``, ``DEFAULT_KERNEL_CONFIG``, ``register_op``,
``registered_ops``, ``BACKENDS``."""

from twinkle.kernel import backends as _backends  # noqa: F401  (registers the accelerator implementations)
from twinkle.kernel import torch_ops as _torch_ops  # noqa: F401  (registers the torch backend)
from twinkle.kernel.config import DEFAULT_KERNEL_CONFIG
from twinkle.kernel.kernelize import kernelize
from twinkle.kernel.registry import BACKENDS, KernelChoice, register_op, registered_ops

__all__ = ["kernelize", "KernelChoice", "DEFAULT_KERNEL_CONFIG", "register_op", "registered_ops", "BACKENDS"]
