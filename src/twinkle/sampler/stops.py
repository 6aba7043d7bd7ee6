"""When a generated sequence ends: its end-of-sequence tokens, stop token ids and stop strings."""

from typing import Any

from twinkle.data_format.sampling import SamplingParams


def eos_token_ids(lm: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a reply: the tokenizer's end-of-sequence token and those of the
    model's generation config (a chat model often lists its end-of-turn token there)."""
    ids: set[int] = set()
    config = getattr(lm, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids


class Stops:
    """The stop conditions of one ``sample`` call.

    ``token_ids``: tokens that end a sequence (kept in it). A stop string ends a sequence at the
    token that completes it; ``hit`` decodes only the last tokens of a row, enough to hold the
    longest stop string (every token decodes to at least one character), so the check costs the
    same at every length."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.token_ids = set(eos_ids) | set(params.stop_token_ids)
        self.strings = list(params.stop_strings)
        self.include = params.include_stop_str_in_output
        self.window = max((len(s) for s in self.strings), default=0) + 1

    def hit(self, tokens: list[int]) -> bool:
        """Whether the sequence ``tokens`` ends with a stop string completed by its last token."""
        if not self.strings:
            return False
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.strings)

    def text(self, tokens: list[int], by_string: bool) -> str:
        """The decoded reply (no special tokens); cut at the first stop string when one ended it."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not by_string:
            return text
        found = [(text.find(s), s) for s in self.strings if s in text]
        if not found:
            return text
        at, stop = min(found)
        return text[: at + len(stop)] if self.include else text[:at]
