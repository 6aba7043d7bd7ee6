"""The tokens between two replies: the end of the model's turn, the observations, and the next
generation prompt, all as the chat template renders them.

The model's own tokens stay exactly as sampled (the log-probs were computed on them); only what
comes after is rendered. A reply ends with the model's end-of-turn token, but the template may
close a turn with more (ChatML writes a newline after ``<|im_end|>``): ``closing`` finds what the
template writes after a reply's text, and ``bridge_text`` adds the part the model did not write."""

from typing import Any

from twinkle.utils.errors import UserError

_MARK = "\u2063twinkle-reply\u2063"  # text no reply contains, to find where a reply's text ends


def closing(template: Any) -> str:
    """What the template writes after an assistant reply's text (``<|im_end|>\\n`` for ChatML)."""
    messages = template.with_default_system([{"role": "user", "content": "question"}])
    text = template.render([*messages, {"role": "assistant", "content": _MARK}])
    if _MARK not in text:
        raise UserError("this chat template drops the assistant's text; it cannot be used for rollouts")
    return text[text.index(_MARK) + len(_MARK) :]


def bridge_text(
    template: Any,
    messages: list[dict[str, Any]],
    observations: list[dict[str, Any]],
    reply_end: str,
    close: str,
    next_turn: bool,
) -> str:
    """The text after a reply: the rest of the template's closing (``reply_end``: the text of the
    stop token the reply ended with, '' when it ended otherwise), the ``observations``, and
    (``next_turn``) the generation prompt of the next reply. ``messages`` end with the reply."""
    messages = template.with_default_system(messages)
    before = template.render(messages)
    after = template.render([*messages, *observations], add_generation_prompt=next_turn)
    if not after.startswith(before):
        raise UserError(
            "this chat template renders earlier turns differently once more turns follow; "
            "multi-turn rollouts need one whose conversation only grows (choose another template)"
        )
    rest = close[len(reply_end) :] if reply_end and close.startswith(reply_end) else close
    return rest + after[len(before) :]
