"""Processors: what turns a rank's encoded rows into the batch a model step runs.

Public names: ``InputProcessor`` (padding collate; set on the model with
``model.set_processor``, the default there, or on a ``DataLoader``), ``collate`` (the padding
function it runs) and ``PROCESSORS`` (the processors by name, as ``set_processor`` takes them)."""

from twinkle.processor.base import PROCESSORS, InputProcessor
from twinkle.processor.collate import collate

__all__ = ["InputProcessor", "PROCESSORS", "collate"]
