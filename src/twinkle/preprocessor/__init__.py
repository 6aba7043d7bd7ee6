"""Row preprocessors: turn a raw data row into chat ``messages``, or a preference row into a
pair ``{'positive': Trajectory, 'negative': Trajectory}``.

Public names: ``Preprocessor``, ``SelfCognitionProcessor``, ``MessagesProcessor``, ``AlpacaProcessor``,
``ToolCallProcessor``, the preference readers ``PreferenceProcessor`` (upstream's name:
``DPOProcessor``), ``EmojiDPOProcessor`` and ``SelfCognitionDPOProcessor``, ``GSM8KProcessor`` (GSM8K rows -> prompts
for a sampler, ``twinkle.preprocessor.llm``), and ``BadRow``: what
a preprocessor raises for a row that cannot become a sample (``Dataset`` names the row's file
and line, or drops it with ``skip_bad_rows``)."""

from twinkle.preprocessor.alpaca import AlpacaProcessor
from twinkle.preprocessor.base import BadRow, MessagesProcessor, Preprocessor
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.preprocessor.preference import (
    DPOProcessor,
    EmojiDPOProcessor,
    PreferenceProcessor,
    SelfCognitionDPOProcessor,
)
from twinkle.preprocessor.self_cognition import SelfCognitionProcessor
from twinkle.preprocessor.tool_call import ToolCallProcessor

__all__ = [
    "Preprocessor",
    "MessagesProcessor",
    "SelfCognitionProcessor",
    "AlpacaProcessor",
    "ToolCallProcessor",
    "PreferenceProcessor",
    "DPOProcessor",
    "EmojiDPOProcessor",
    "SelfCognitionDPOProcessor",
    "GSM8KProcessor",
    "BadRow",
]
