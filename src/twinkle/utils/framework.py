"""``Torch``: questions about the torch build and the devices of this machine."""

import importlib.util

import torch


class Torch:
    """Static queries; nothing here initialises a device."""

    @staticmethod
    def is_gpu_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def is_npu_available() -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401

        return hasattr(torch, "npu") and torch.npu.is_available()

    @staticmethod
    def device_type() -> str:
        """The accelerator this process should use: cuda > npu > cpu."""
        if Torch.is_gpu_available():
            return "cuda"
        if Torch.is_npu_available():
            return "npu"
        return "cpu"
