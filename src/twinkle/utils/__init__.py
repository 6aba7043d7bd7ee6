"""Small shared utilities: ``get_logger``, ``Torch`` (device queries), atomic file helpers."""

from twinkle.utils.logger import get_logger

__all__ = ["get_logger"]
