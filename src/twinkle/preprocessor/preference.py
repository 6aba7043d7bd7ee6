"""Preference rows (a prompt, a chosen and a rejected reply) -> ``{'positive': Trajectory,
'negative': Trajectory}``: the same prompt, followed by the chosen reply on the positive side
and by the rejected reply on the negative side.

A row that cannot become a pair raises ``BadRow`` naming its field, so ``Dataset`` names its
file and line, or drops it with ``--skip-bad-rows``. An identical chosen and rejected reply is
such a row: it teaches no preference (refused by default, dropped and counted with
``--skip-bad-rows``, like every other bad row)."""

from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import ROLES, SPOKEN_ROLES, BadRow, Preprocessor
from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT
from twinkle.utils.values import kind_of

# ms-swift's name of the rejected reply next to ``messages`` that end with the chosen one
SWIFT_REJECTED = "rejected_response"


def as_messages(value: Any, key: str, index: int | None, text_role: str) -> list[Message]:
    """``value`` as checked ``{'role', 'content'}`` messages: text is one ``text_role`` turn, an
    object one message, a list a conversation. Field names in errors start with ``key``."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(index, key, f": {key!r} is empty")
        return [{"role": text_role, "content": value}]
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list):
        raise BadRow(index, key, f": {key!r} is {kind_of(value)}, not text or a list of messages")
    if not items:
        raise BadRow(index, key, f": {key!r} is an empty list")
    out: list[Message] = []
    for i, m in enumerate(items):
        field = f"{key}[{i}]" if isinstance(value, list) else key
        if not isinstance(m, dict):
            raise BadRow(index, field, f": {field} is {kind_of(m)}, not a message {{'role', 'content'}}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRow(
                index, f"{field}.role", f": {field}.role is {role!r}; each message needs a role in {ROLES}"
            )
        if not isinstance(content, str):
            raise BadRow(
                index, f"{field}.content", f": {field}.content ({role}) is {kind_of(content)}, not text"
            )
        if role in SPOKEN_ROLES and not content.strip():
            raise BadRow(index, f"{field}.content", f": {field}.content ({role}) is empty")
        out.append({"role": role, "content": content})
    return out


def _same(a: Message, b: Message) -> bool:
    return a["role"] == b["role"] and a["content"].strip() == b["content"].strip()


def split_pair(
    positive: list[Message], negative: list[Message], index: int | None, names: tuple[str, str]
) -> int:
    """How many leading messages the two conversations share (their prompt), checked: both
    share a non-empty prompt, then each continues with an assistant turn and ends with one, and
    the replies differ. ``names`` name the two sides in errors (``chosen``/``rejected``)."""
    shared = 0
    while shared < min(len(positive), len(negative)) and _same(positive[shared], negative[shared]):
        shared += 1
    pos_name, neg_name = names
    if shared == len(positive) == len(negative):
        raise BadRow(
            index,
            pos_name,
            f": {pos_name!r} and {neg_name!r} are the same reply, so the pair teaches no preference; "
            "make them differ",
        )
    for name, side, other in ((pos_name, positive, neg_name), (neg_name, negative, pos_name)):
        if shared == len(side):
            raise BadRow(
                index,
                name,
                f": {name!r} has no reply of its own, it is the start of {other!r}; "
                "each side needs its own final assistant reply",
            )
    if shared == 0:
        raise BadRow(
            index,
            pos_name,
            f": {pos_name!r} and {neg_name!r} share no prompt; give the prompt in 'prompt' or 'messages', "
            "or start both conversations with it",
        )
    for name, side in ((pos_name, positive), (neg_name, negative)):
        if side[shared]["role"] != "assistant":
            raise BadRow(
                index,
                name,
                f": {pos_name!r} and {neg_name!r} differ before the reply (message {shared} is a "
                f"{side[shared]['role']} turn); both sides need the same prompt and differ in the assistant reply",
            )
        if side[-1]["role"] != "assistant":
            raise BadRow(
                index, name, f": {name!r} ends with a {side[-1]['role']} turn, not an assistant reply"
            )
    return shared


class PreferenceProcessor(Preprocessor):
    """Read a preference row in any of the common forms:

    - ``prompt``, ``chosen`` and ``rejected`` as text (TRL's standard form with a prompt);
    - ``prompt`` as text or a message list, ``chosen`` and ``rejected`` as message lists of the
      reply (TRL's conversational form with a prompt; a single message object works too);
    - ``chosen`` and ``rejected`` as whole conversations that start with the same prompt (TRL's
      conversational form with an implicit prompt; a ``prompt`` column next to them is ignored,
      as in UltraFeedback-binarized rows that carry both);
    - ``messages`` ending with a user turn, and ``chosen``/``rejected`` (text or messages);
    - ``messages`` ending with the chosen assistant turn, and ``rejected`` (or ms-swift's
      ``rejected_response``) holding the other reply.

    Returns ``{'positive': Trajectory, 'negative': Trajectory}`` whose messages hold only
    ``role`` and ``content``; ``system`` is the system turn of rows whose prompt has none.
    Raises ``BadRow`` for a row without a chosen or rejected side, with empty or non-text
    replies, with sides that differ before the reply, or with the same reply on both sides."""

    def __init__(
        self,
        system: str | None = None,
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        prompt_key: str = "prompt",
        messages_key: str = "messages",
    ):
        self.system = system
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.prompt_key = prompt_key
        self.messages_key = messages_key

    def fill(self, text: str) -> str:
        """Applied to every message's text; subclasses fill placeholders."""
        return text

    def preprocess(self, row: dict[str, Any], index: int | None = None) -> dict[str, Trajectory]:
        chosen, rejected, prompt = self._parts(row, index)
        if prompt is None:
            positive = as_messages(chosen, self.chosen_key, index, "assistant")
            negative = as_messages(rejected, self.rejected_key, index, "assistant")
            if isinstance(chosen, str) or isinstance(rejected, str):
                raise BadRow(
                    index,
                    self.prompt_key,
                    f" has no {self.prompt_key!r} or {self.messages_key!r} before its text replies; "
                    "add the prompt, or give whole conversations as chosen and rejected",
                )
        else:
            positive = prompt + as_messages(chosen, self.chosen_key, index, "assistant")
            negative = prompt + as_messages(rejected, self.rejected_key, index, "assistant")
        positive, negative = self._filled(positive), self._filled(negative)
        split_pair(positive, negative, index, (self.chosen_key, self.rejected_key))
        if self.system is not None and positive[0]["role"] != "system":
            system: Message = {"role": "system", "content": self.system}
            positive, negative = [system, *positive], [system, *negative]
        return {"positive": {"messages": positive}, "negative": {"messages": negative}}

    def _filled(self, messages: list[Message]) -> list[Message]:
        return [{"role": m["role"], "content": self.fill(m["content"])} for m in messages]

    def _parts(self, row: dict[str, Any], index: int | None) -> tuple[Any, Any, list[Message] | None]:
        """``(chosen, rejected, prompt messages)``; the prompt is None when the sides must carry
        it (whole conversations)."""
        chosen, rejected = row.get(self.chosen_key), row.get(self.rejected_key)
        if rejected is None and self.rejected_key == "rejected":
            rejected = row.get(SWIFT_REJECTED)
        messages = row.get(self.messages_key)
        prompt: list[Message] | None = None
        if messages is not None:
            prompt = as_messages(messages, self.messages_key, index, "user")
            if chosen is None and prompt[-1]["role"] == "assistant":
                chosen, prompt = [prompt[-1]], prompt[:-1]
        elif row.get(self.prompt_key) is not None:
            prompt = as_messages(row[self.prompt_key], self.prompt_key, index, "user")
        for key, value in ((self.chosen_key, chosen), (self.rejected_key, rejected)):
            if value is None:
                present = sorted(k for k, v in row.items() if v is not None)
                raise BadRow(
                    index,
                    key,
                    f" has no {key!r} side (it has {', '.join(present) or 'no fields'}); every preference row "
                    f"needs a {self.chosen_key!r} and a {self.rejected_key!r} reply",
                )
        if prompt is not None and _whole_conversations(chosen, rejected):
            prompt = None
        return chosen, rejected, prompt


def _whole_conversations(chosen: Any, rejected: Any) -> bool:
    """Both sides are message lists that start before the reply (with the prompt's turns)."""

    def starts_before_reply(value: Any) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and isinstance(value[0], dict)
            and value[0].get("role") in ("system", "user")
        )

    return starts_before_reply(chosen) and starts_before_reply(rejected)


class DPOProcessor(PreferenceProcessor):
    """Upstream's name of ``PreferenceProcessor``."""


class EmojiDPOProcessor(PreferenceProcessor):
    """Rows of shareAI's DPO-zh-en-emoji set: ``prompt`` text, ``answer_zh`` (the chosen reply,
    in Chinese with emoji) and ``answer_en`` (the rejected one); the keys are upstream's
    defaults and can be renamed. ``system`` is the system turn of every pair."""

    def __init__(
        self,
        system: str | None = None,
        chosen_key: str = "answer_zh",
        rejected_key: str = "answer_en",
        prompt_key: str = "prompt",
    ):
        super().__init__(system, chosen_key, rejected_key, prompt_key)


class SelfCognitionDPOProcessor(PreferenceProcessor):
    """The bundled self-cognition preference rows (``self-cognition-dpo``: ``prompt``,
    ``chosen`` answering as the configured assistant, ``rejected`` a generic or wrong identity):
    ``{{NAME}}`` and ``{{AUTHOR}}`` are filled in every turn, and the system turn is the one
    ``SelfCognitionProcessor`` and ``twinkle chat`` use, so the preference is learnt under the
    prompt it will be asked with."""

    def __init__(self, model_name: str, model_author: str, system: str = SYSTEM_PROMPT, **keys: str):
        super().__init__(system, **keys)
        self.model_name = model_name
        self.model_author = model_author

    def fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)
