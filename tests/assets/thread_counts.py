"""Run a function with torch's intra-op thread count set for the call, then restored: the C
kernels' tests compare results across thread counts."""

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def on_threads(n: int, fn: Callable[[], T]) -> T:
    """``fn()`` with ``torch.set_num_threads(n)``, the previous count restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)
