"""Row preprocessors: turn raw data rows into chat ``messages``, or preference rows into pairs
``{'positive': Trajectory, 'negative': Trajectory}``.

Public names: ``Preprocessor`` (upstream's call shape: a batch of rows as columns in, columns
out; ``map_col_to_row`` / ``map_row_to_col``), ``DataFilter`` (``row -> bool``),
``SelfCognitionProcessor``, ``MessagesProcessor``, ``AlpacaProcessor``, ``ToolCallProcessor``, the
preference readers ``PreferenceProcessor`` (upstream's name: ``DPOProcessor``),
``EmojiDPOProcessor`` and ``SelfCognitionDPOProcessor``, the math prompts ``GSM8KProcessor``,
``CompetitionMathProcessor`` and ``CompetitionMathGRPOProcessor`` (``twinkle.preprocessor.llm``)
and ``OlympiadBenchProcessor`` (``twinkle.preprocessor.olympiad_bench``), and ``BadRow``: what a
preprocessor raises for a row that cannot become a sample (``Dataset`` names the row's file and
line, or drops it with ``skip_bad_rows``)."""

from twinkle.preprocessor.alpaca import AlpacaProcessor
from twinkle.preprocessor.base import BadRow, DataFilter, MessagesProcessor, Preprocessor
from twinkle.preprocessor.llm import CompetitionMathGRPOProcessor, CompetitionMathProcessor, GSM8KProcessor
from twinkle.preprocessor.olympiad_bench import OlympiadBenchProcessor
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
    "DataFilter",
    "MessagesProcessor",
    "SelfCognitionProcessor",
    "AlpacaProcessor",
    "ToolCallProcessor",
    "PreferenceProcessor",
    "DPOProcessor",
    "EmojiDPOProcessor",
    "SelfCognitionDPOProcessor",
    "GSM8KProcessor",
    "CompetitionMathProcessor",
    "CompetitionMathGRPOProcessor",
    "OlympiadBenchProcessor",
    "BadRow",
]
