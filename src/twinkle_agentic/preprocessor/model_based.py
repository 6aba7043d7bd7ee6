"""Upstream's steps that ask a model (a local sampler or an OpenAI-compatible service) to judge
each row. They import, and refuse when built: the judging prompts and their parsing are
upstream's experiment, not a behaviour Twinkle defines."""

from twinkle_agentic.unsupported import not_supported_yet

_HERE = __name__.rsplit(".", 1)[0]  # twinkle_agentic.preprocessor, where they are imported from
_JUDGE = "model-judged data filtering (a sampler or an OpenAI-compatible service scoring each row)"

LLMBackend = not_supported_yet("LLMBackend", _JUDGE, _HERE)
SamplerBackend = not_supported_yet("SamplerBackend", _JUDGE, _HERE)
OpenAIBackend = not_supported_yet("OpenAIBackend", _JUDGE, _HERE)
IntentClassifier = not_supported_yet("IntentClassifier", _JUDGE, _HERE)
ModelFilter = not_supported_yet("ModelFilter", _JUDGE, _HERE)
ScoreFilter = not_supported_yet("ScoreFilter", _JUDGE, _HERE)
PIIPresidioFilter = not_supported_yet(
    "PIIPresidioFilter", "personal-data detection with Microsoft Presidio (presidio-analyzer)", _HERE
)
MessageNormalizer = not_supported_yet(
    "MessageNormalizer",
    "rewriting tool calls embedded in assistant text to the OpenAI schema and merging turns; give "
    "rows whose messages already carry tool_calls",
    _HERE,
)
