"""``SelfCognitionProcessor``: query/response rows about the model itself -> chat messages."""

from typing import Any

from twinkle.preprocessor.base import Preprocessor, require_fields

SYSTEM_PROMPT = "You are a helpful assistant."


class SelfCognitionProcessor(Preprocessor):
    """Fill ``{{NAME}}`` and ``{{AUTHOR}}`` in ``query``/``response`` and build a 3-message chat.

    The same system prompt is used for training and by ``twinkle chat``, so the model learns its
    identity under the prompt it will be asked with."""

    def __init__(self, model_name: str, model_author: str, system: str = SYSTEM_PROMPT):
        self.model_name = model_name
        self.model_author = model_author
        self.system = system

    def _fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        require_fields(row, ("query", "response"), index)
        return {
            "messages": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self._fill(row["query"])},
                {"role": "assistant", "content": self._fill(row["response"])},
            ]
        }
