"""``Template``: the tokenizer's own chat template, with labels on assistant tokens only."""

from typing import Any

from twinkle.utils.errors import UserError

IGNORE_INDEX = -100
TRUNCATION_STRATEGIES = ("raise", "left", "right", "delete")

Segment = tuple[str, bool]  # (text, supervised)


class Template:
    """Encode chat messages with ``tokenizer.apply_chat_template``.

    The conversation is rendered once per assistant turn to find where each reply starts and
    ends; each piece is tokenised on its own so the label mask falls exactly on token borders.
    System, user and template tokens get label ``-100``; the assistant's reply and everything
    the template writes after it up to the next turn (its end-of-turn tokens, a newline) are
    supervised."""

    def __init__(self, tokenizer: Any, max_length: int = 1024, truncation_strategy: str = "right"):
        if truncation_strategy not in TRUNCATION_STRATEGIES:
            raise UserError(
                f"--truncation-strategy: {truncation_strategy!r} is not one of {', '.join(TRUNCATION_STRATEGIES)}"
            )
        if max_length < 1:
            raise UserError(f"--max-length must be at least 1, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(
                "the tokenizer has no chat template; use a chat model or pick one with --template-cls"
            )
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def segments(self, messages: list[dict[str, str]]) -> list[Segment]:
        """Split the rendered conversation into unsupervised and supervised (assistant) pieces."""
        full = self.render(messages)
        pieces: list[Segment] = []
        pos = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i == 0:
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            start, end = len(prompt), len(upto)
            # Offsets are only valid if each partial render is a prefix of the whole: templates
            # that render the last turn differently (e.g. an empty <think> block) are not.
            if not (pos <= start <= end and full.startswith(upto) and upto.startswith(prompt)):
                raise UserError(
                    "this chat template does not render a conversation as a sequence of its turns; "
                    "choose another --template-cls"
                )
            pieces += [(full[pos:start], False), (full[start:end], True)]
            pos = end
        pieces.append((full[pos:], False))
        return [p for p in pieces if p[0]]

    def tokenize(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        input_ids: list[int] = []
        labels: list[int] = []
        for text, supervised in self.segments(messages):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            input_ids += ids
            labels += ids if supervised else [IGNORE_INDEX] * len(ids)
        return input_ids, labels

    def encode(self, messages: list[dict[str, str]], index: int | None = None) -> dict[str, Any] | None:
        """Tokenise and truncate one conversation; ``None`` means the row is dropped (``delete``)."""
        input_ids, labels = self.tokenize(messages)
        n, limit = len(input_ids), self.max_length
        if n > limit:
            strategy = self.truncation_strategy
            if strategy == "raise":
                where = f"sample {index}" if index is not None else "a sample"
                raise UserError(
                    f"{where} has {n} tokens, more than --max-length {limit}; raise --max-length or pass "
                    f"--truncation-strategy left, right or delete"
                )
            if strategy == "delete":
                return None
            keep = slice(n - limit, n) if strategy == "left" else slice(0, limit)
            input_ids, labels = input_ids[keep], labels[keep]
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": [1] * len(input_ids),
            "position_ids": list(range(len(input_ids))),
            "length": len(input_ids),
        }
