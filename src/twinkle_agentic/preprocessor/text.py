"""What the quality filters read from a messages row: the text of a message, of a role's turns,
and whether a text is mostly CJK."""

import re
from collections.abc import Mapping
from typing import Any

CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def content_text(content: Any) -> str:
    """A message's ``content`` as text: a string as it is, the text parts of a multimodal list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text") or "")
            for part in content
            if isinstance(part, Mapping) and part.get("type", "text") == "text"
        )
    return str(content)


def messages_of(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The row's ``messages`` (a list of mappings), empty when it has none."""
    messages = row.get("messages")
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def role_texts(row: Mapping[str, Any], role: str, reasoning: bool = False) -> list[str]:
    """The text of every ``role`` message of the row; with ``reasoning``, each message's
    ``reasoning_content`` too (as its own text)."""
    texts = []
    for message in messages_of(row):
        if message.get("role") != role:
            continue
        texts.append(content_text(message.get("content")))
        if reasoning and message.get("reasoning_content"):
            texts.append(content_text(message.get("reasoning_content")))
    return texts


def mostly_cjk(text: str) -> bool:
    """Whether CJK characters outnumber the other letters and digits of ``text``."""
    cjk = len(CJK.findall(text))
    other = sum(ch.isalnum() for ch in text) - cjk
    return cjk > other
