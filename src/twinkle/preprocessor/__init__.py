"""Row preprocessors: turn a raw data row into chat ``messages``.

Public names: ``Preprocessor``, ``SelfCognitionProcessor``, ``MessagesProcessor``, ``AlpacaProcessor``,
``ToolCallProcessor``."""

from twinkle.preprocessor.alpaca import AlpacaProcessor
from twinkle.preprocessor.base import MessagesProcessor, Preprocessor
from twinkle.preprocessor.self_cognition import SelfCognitionProcessor
from twinkle.preprocessor.tool_call import ToolCallProcessor

__all__ = [
    "Preprocessor",
    "MessagesProcessor",
    "SelfCognitionProcessor",
    "AlpacaProcessor",
    "ToolCallProcessor",
]
