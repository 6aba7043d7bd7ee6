"""Row preprocessors: turn a raw data row into chat ``messages``.

Public names: ``Preprocessor``, ``SelfCognitionProcessor``, ``MessagesProcessor``."""

from twinkle.preprocessor.base import MessagesProcessor, Preprocessor
from twinkle.preprocessor.self_cognition import SelfCognitionProcessor

__all__ = ["Preprocessor", "MessagesProcessor", "SelfCognitionProcessor"]
