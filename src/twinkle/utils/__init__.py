"""Small shared utilities. Public here: ``get_logger``; see also ``utils.framework.Torch``
(device queries), ``utils.fileio`` (atomic writes, locks) and ``utils.errors.UserError``."""

from twinkle.utils.logger import get_logger

__all__ = ["get_logger"]
