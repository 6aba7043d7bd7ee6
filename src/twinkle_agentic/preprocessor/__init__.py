"""Quality steps for chat data (rows with ``messages``), run in order by ``QualityPreprocessor``.

Public names:

- ``QualityPreprocessor(pipeline, dropped_log_path='')``: the runner (a ``Preprocessor``).
- row filters, each ``step(rows) -> (kept, dropped)``: ``HardFilter``, ``RefuseFilter``,
  ``DeadLoopFilter``, ``TokenSoupFilter``, ``SpecialCharsFilter``, ``DedupFilter``,
  ``MessageSanityFilter``, ``TokenNumFilter``;
- text rewrites (drop nothing): ``FixUnicodeFilter``, ``RemoveRepeatSentencesFilter``;
- ``FilterStep`` and ``MapStep``, the bases to write a step of one's own.

Upstream's model-judged steps (``IntentClassifier``, ``ModelFilter``, ``ScoreFilter``,
``SamplerBackend``, ``OpenAIBackend``, ``LLMBackend``), ``PIIPresidioFilter`` and
``MessageNormalizer`` import and refuse in one line when built (not supported yet)."""

from twinkle_agentic.preprocessor.filters import (
    DeadLoopFilter,
    DedupFilter,
    HardFilter,
    RefuseFilter,
    SpecialCharsFilter,
    TokenSoupFilter,
)
from twinkle_agentic.preprocessor.mappers import FixUnicodeFilter, RemoveRepeatSentencesFilter, TokenNumFilter
from twinkle_agentic.preprocessor.model_based import (
    IntentClassifier,
    LLMBackend,
    MessageNormalizer,
    ModelFilter,
    OpenAIBackend,
    PIIPresidioFilter,
    SamplerBackend,
    ScoreFilter,
)
from twinkle_agentic.preprocessor.pipeline import QualityPreprocessor
from twinkle_agentic.preprocessor.sanity import MessageSanityFilter
from twinkle_agentic.preprocessor.step import FilterStep, MapStep

__all__ = [
    "QualityPreprocessor",
    "FilterStep",
    "MapStep",
    "HardFilter",
    "RefuseFilter",
    "DeadLoopFilter",
    "TokenSoupFilter",
    "SpecialCharsFilter",
    "DedupFilter",
    "MessageSanityFilter",
    "FixUnicodeFilter",
    "RemoveRepeatSentencesFilter",
    "TokenNumFilter",
    "IntentClassifier",
    "ModelFilter",
    "ScoreFilter",
    "SamplerBackend",
    "OpenAIBackend",
    "LLMBackend",
    "PIIPresidioFilter",
    "MessageNormalizer",
]
