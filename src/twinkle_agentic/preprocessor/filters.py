"""Row filters for chat data: each drops a row for one kind of defect, and names it.

``HardFilter`` (structure and size limits), ``RefuseFilter`` (the assistant declines),
``DeadLoopFilter`` (the assistant repeats itself), ``TokenSoupFilter`` (garbled characters),
``SpecialCharsFilter`` (mostly symbols), ``DedupFilter`` (the same exchange twice: the longest
copy is kept)."""

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.preprocessor.step import FilterStep, Rows
from twinkle_agentic.preprocessor.text import CJK, content_text, messages_of, mostly_cjk, role_texts


class HardFilter(FilterStep):
    """Drops a row that is not a usable conversation: no user turn, a first user turn shorter than
    ``min_user_chars`` (``min_user_chars_cjk`` for mostly-CJK text), no final assistant answer
    (unless ``allow_incomplete_role``), a system prompt holding one of ``system_deny_keywords``,
    more than ``max_rounds`` user turns, more than ``max_total_chars`` characters, or a round
    (a user turn and the replies up to the next one) longer than ``max_chars_per_round``."""

    def __init__(
        self,
        min_user_chars: int = 10,
        min_user_chars_cjk: int = 6,
        allow_incomplete_role: bool = False,
        system_deny_keywords: list[str] | None = None,
        max_chars_per_round: int | None = None,
        max_total_chars: int | None = None,
        max_rounds: int | None = None,
    ) -> None:
        self.min_user_chars, self.min_user_chars_cjk = min_user_chars, min_user_chars_cjk
        self.allow_incomplete_role = allow_incomplete_role
        self.system_deny_keywords = [k.lower() for k in system_deny_keywords or []]
        self.max_chars_per_round, self.max_total_chars = max_chars_per_round, max_total_chars
        self.max_rounds = max_rounds

    def reason(self, row: Mapping[str, Any]) -> str | None:
        messages = messages_of(row)
        users = [content_text(m.get("content")).strip() for m in messages if m.get("role") == "user"]
        if not users:
            return "no_user_turn"
        least = self.min_user_chars_cjk if mostly_cjk(users[0]) else self.min_user_chars
        if len(users[0]) < least:
            return "user_turn_too_short"
        last = messages[-1]
        if not self.allow_incomplete_role and (
            last.get("role") != "assistant"
            or not (content_text(last.get("content")).strip() or last.get("tool_calls"))
        ):
            return "no_final_answer"
        system = " ".join(
            content_text(m.get("content")) for m in messages if m.get("role") == "system"
        ).lower()
        if any(keyword in system for keyword in self.system_deny_keywords):
            return "system_keyword"
        if self.max_rounds is not None and len(users) > self.max_rounds:
            return "too_many_rounds"
        sizes = [len(content_text(m.get("content"))) for m in messages]
        if self.max_total_chars is not None and sum(sizes) > self.max_total_chars:
            return "too_long"
        if self.max_chars_per_round is not None:
            rounds, size = [], 0
            for message, chars in zip(messages, sizes, strict=True):
                if message.get("role") == "user" and size:
                    rounds.append(size)
                    size = 0
                size += chars
            if max([*rounds, size]) > self.max_chars_per_round:
                return "round_too_long"
        return None


# Openings of a reply that declines the request (English and Chinese), matched case-insensitively.
REFUSALS = (
    r"\bI(?:'m| am) (?:sorry|afraid),? but I (?:can(?:no|')t|am unable|won't)",
    r"\bI (?:can(?:no|')t|won't|am unable to|'m unable to) (?:help|assist|provide|comply|fulfill|do that)",
    r"\bas an AI(?: language model)?,? I (?:can(?:no|')t|don't|do not|am not able)",
    r"\bI(?:'m| am) not able to (?:help|assist|provide|comply)",
    r"抱歉，?我(?:无法|不能)",
    r"对不起，?我(?:无法|不能)",
    r"作为一个?(?:人工智能|AI)(?:语言模型|助手)?，?我(?:无法|不能)",
    r"我无法(?:提供|协助|帮助|回答)",
)
_REFUSAL = re.compile("|".join(REFUSALS), re.IGNORECASE)


class RefuseFilter(FilterStep):
    """Drops a row in which an assistant reply declines the request within its first
    ``check_window`` characters (``REFUSALS``)."""

    def __init__(self, check_window: int = 600) -> None:
        if check_window <= 0:
            raise UserError(f"RefuseFilter(check_window=...): must be positive, got {check_window}")
        self.check_window = check_window

    def reason(self, row: Mapping[str, Any]) -> str | None:
        for text in role_texts(row, "assistant"):
            if _REFUSAL.search(text[: self.check_window]):
                return "refusal"
        return None


_WORD = re.compile(rf"{CJK.pattern}|[^\W\u3040-\u30ff\u3400-\u9fff]+")


def repeated_fraction(text: str, ngram_size: int) -> float:
    """The share of ``text``'s word n-grams (a CJK character counts as a word) that repeat an
    earlier one: 0 for text without repeats, near 1 for a reply stuck in a loop."""
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


class DeadLoopFilter(FilterStep):
    """Drops a row in which an assistant reply (or its ``reasoning_content``) of at least
    ``ngram_min_words`` words repeats itself: more than ``repetition_threshold`` of its
    ``ngram_size``-word n-grams occur earlier in it."""

    def __init__(
        self, repetition_threshold: float = 0.45, ngram_size: int = 8, ngram_min_words: int = 30
    ) -> None:
        if not 0 < repetition_threshold < 1 or ngram_size < 1:
            raise UserError(
                "DeadLoopFilter: repetition_threshold must be in (0, 1) and ngram_size at least 1, "
                f"got {repetition_threshold} and {ngram_size}"
            )
        self.repetition_threshold, self.ngram_size = repetition_threshold, ngram_size
        self.ngram_min_words = ngram_min_words

    def reason(self, row: Mapping[str, Any]) -> str | None:
        for text in role_texts(row, "assistant", reasoning=True):
            if len(_WORD.findall(text)) < self.ngram_min_words:
                continue
            if repeated_fraction(text, self.ngram_size) > self.repetition_threshold:
                return "dead_loop"
        return None


class TokenSoupFilter(FilterStep):
    """Drops a row with garbled text in any message: more than ``replacement_char_ratio`` of its
    characters U+FFFD, ``control_char_ratio`` control characters (tabs and newlines aside),
    ``private_use_ratio`` private-use characters. ``max_chars`` > 0 reads only each text's first
    ``max_chars`` characters."""

    def __init__(
        self,
        replacement_char_ratio: float = 0.02,
        control_char_ratio: float = 0.01,
        private_use_ratio: float = 0.03,
        max_chars: int = 0,
    ) -> None:
        self.limits = {
            "replacement_chars": replacement_char_ratio,
            "control_chars": control_char_ratio,
            "private_use_chars": private_use_ratio,
        }
        self.max_chars = max_chars

    @staticmethod
    def _counts(text: str) -> dict[str, int]:
        counts = {"replacement_chars": 0, "control_chars": 0, "private_use_chars": 0}
        for ch in text:
            if ch == "\ufffd":
                counts["replacement_chars"] += 1
            elif ch not in "\n\r\t" and unicodedata.category(ch) == "Cc":
                counts["control_chars"] += 1
            elif unicodedata.category(ch) == "Co":
                counts["private_use_chars"] += 1
        return counts

    def reason(self, row: Mapping[str, Any]) -> str | None:
        for message in messages_of(row):
            text = content_text(message.get("content"))
            if self.max_chars > 0:
                text = text[: self.max_chars]
            if not text:
                continue
            for kind, count in self._counts(text).items():
                if count / len(text) > self.limits[kind]:
                    return kind
        return None


class SpecialCharsFilter(FilterStep):
    """Drops a row whose ``role`` text is more than ``max_ratio`` symbols (characters that are
    neither letters, digits nor whitespace)."""

    def __init__(self, max_ratio: float = 0.25, role: str = "assistant") -> None:
        self.max_ratio, self.role = max_ratio, role

    def reason(self, row: Mapping[str, Any]) -> str | None:
        text = "\n".join(role_texts(row, self.role))
        if not text:
            return None
        symbols = sum(not (ch.isalnum() or ch.isspace()) for ch in text)
        return "special_chars" if symbols / len(text) > self.max_ratio else None


class DedupFilter(FilterStep):
    """Keeps one row per exchange: rows whose first user turn and first assistant reply agree in
    their first and last ``prefix_chars`` / ``asst_chars`` characters are copies, and the longest
    copy (all message text counted) is kept, in its place; the others are dropped. It compares the
    rows of one call, so give it the whole set (``Dataset.map`` with ``batched=True`` compares
    within each batch)."""

    def __init__(self, prefix_chars: int = 100, asst_chars: int = 100) -> None:
        self.prefix_chars, self.asst_chars = prefix_chars, asst_chars

    def key(self, row: Mapping[str, Any]) -> tuple[str, str]:
        user = next(iter(role_texts(row, "user")), "").strip()
        reply = next(iter(role_texts(row, "assistant")), "").strip()
        return (
            user[: self.prefix_chars] + "\x00" + user[-self.prefix_chars :],
            reply[: self.asst_chars] + "\x00" + reply[-self.asst_chars :],
        )

    def __call__(self, rows: Any) -> tuple[Rows, Rows]:  # type: ignore[override]
        rows = self.map_col_to_row(rows)
        best: dict[tuple[str, str], tuple[int, int]] = {}
        for index, row in enumerate(rows):
            size = sum(len(content_text(m.get("content"))) for m in messages_of(row))
            key = self.key(row)
            if key not in best or size > best[key][1]:
                best[key] = (index, size)
        winners = {index for index, _ in best.values()}
        kept = [row for index, row in enumerate(rows) if index in winners]
        dropped = [
            {**row, "drop_reason": "duplicate"} for index, row in enumerate(rows) if index not in winners
        ]
        return kept, dropped
