"""Steps that rewrite text and drop nothing (``FixUnicodeFilter``, ``RemoveRepeatSentencesFilter``),
and ``TokenNumFilter``, which counts a role's tokens with a model's tokenizer."""

import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.preprocessor.step import FilterStep, MapStep
from twinkle_agentic.preprocessor.text import role_texts

FORMS = ("NFC", "NFKC", "NFD", "NFKD")


def _rewrite_role(row: dict[str, Any], role: str, fix: Callable[[str], str]) -> dict[str, Any]:
    """``row`` with ``fix`` applied to the string contents of its ``role`` messages (a list of
    parts is left as it is)."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        return row
    row["messages"] = [
        {**m, "content": fix(m["content"])}
        if isinstance(m, Mapping) and m.get("role") == role and isinstance(m.get("content"), str)
        else m
        for m in messages
    ]
    return row


class FixUnicodeFilter(MapStep):
    """Brings the ``role`` messages' text to the Unicode ``normalization`` form (NFC: composed
    characters, so equal text compares and tokenizes equal) and removes zero-width and
    byte-order-mark characters."""

    def __init__(self, normalization: str = "NFC", role: str = "assistant") -> None:
        if normalization.upper() not in FORMS:
            raise UserError(
                f"FixUnicodeFilter(normalization=...): one of {', '.join(FORMS)}, got {normalization!r}"
            )
        self.normalization, self.role = normalization.upper(), role

    def fix(self, text: str) -> str:
        text = re.sub("[\u200b\u200c\u200d\u2060\ufeff]", "", text)
        return unicodedata.normalize(self.normalization, text)

    def rewrite(self, row: dict[str, Any]) -> dict[str, Any]:
        return _rewrite_role(row, self.role, self.fix)


# A sentence ends at . ! ? followed by whitespace, at a CJK full stop, or at a newline.
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)|(?<=[。！？\n])")


class RemoveRepeatSentencesFilter(MapStep):
    """Removes every sentence of the ``role`` messages that repeats an earlier sentence of the
    same message. Sentences compare after ``lowercase`` and, with ``ignore_special_character``,
    with everything but letters and digits removed; a sentence with fewer than
    ``min_repeat_chars`` such characters is never removed (list markers, ``Yes.``)."""

    def __init__(
        self,
        lowercase: bool = False,
        ignore_special_character: bool = True,
        role: str = "assistant",
        min_repeat_chars: int = 2,
    ) -> None:
        self.lowercase, self.ignore_special_character = lowercase, ignore_special_character
        self.role, self.min_repeat_chars = role, min_repeat_chars

    def _key(self, sentence: str) -> str:
        key = sentence.lower() if self.lowercase else sentence
        if self.ignore_special_character:
            key = "".join(ch for ch in key if ch.isalnum())
        return key.strip()

    def fix(self, text: str) -> str:
        seen: set[str] = set()
        out = []
        for sentence in _SENTENCE_END.split(text):
            key = self._key(sentence)
            if len(key) >= self.min_repeat_chars and key in seen:
                continue
            seen.add(key)
            out.append(sentence)
        return "".join(out)

    def rewrite(self, row: dict[str, Any]) -> dict[str, Any]:
        return _rewrite_role(row, self.role, self.fix)


class TokenNumFilter(FilterStep):
    """Drops a row whose ``role`` text has fewer than ``min_num`` or more than ``max_num`` tokens
    of ``hf_tokenizer`` (a model id or folder, as ``Template`` takes; loaded on first use)."""

    def __init__(
        self,
        hf_tokenizer: str | None = "Qwen/Qwen2.5-0.5B",
        min_num: int = 10,
        max_num: int = 8192,
        role: str = "assistant",
    ) -> None:
        if min_num > max_num:
            raise UserError(f"TokenNumFilter: min_num {min_num} is above max_num {max_num}")
        self.hf_tokenizer, self.min_num, self.max_num, self.role = hf_tokenizer, min_num, max_num, role

    def count(self, text: str) -> int:
        from twinkle.template.tokenizer import load_tokenizer

        return len(load_tokenizer(self.hf_tokenizer)(text, add_special_tokens=False)["input_ids"])

    def reason(self, row: Mapping[str, Any]) -> str | None:
        tokens = self.count("\n".join(role_texts(row, self.role)))
        return None if self.min_num <= tokens <= self.max_num else "token_count_out_of_range"
