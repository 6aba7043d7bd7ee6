"""The module-op backends: ``torch_ops`` (runs anywhere), ``liger`` (CUDA), ``npu`` (Ascend).
Importing this package registers them."""

from twinkle.kernel.backends import liger, npu, torch_ops  # noqa: F401  (registers their implementations)
