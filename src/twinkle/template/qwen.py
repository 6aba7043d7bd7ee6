"""``Qwen3_5Template``: ChatML as Qwen3/Qwen3.5 expect it in non-thinking mode."""

from twinkle.template.base import Segment, Template


class Qwen3_5Template(Template):
    """ChatML written out here rather than taken from the tokenizer, so that every assistant turn
    carries the empty ``<think>`` block Qwen3.5 emits when thinking is off (the tokenizer's own
    template drops it from past turns, which would make training and inference disagree)."""

    THINK = "<think>\n\n</think>\n\n"

    def segments(self, messages: list[dict[str, str]]) -> list[Segment]:
        pieces: list[Segment] = []
        for m in messages:
            if m["role"] == "assistant":
                pieces.append(("<|im_start|>assistant\n" + self.THINK, False))
                pieces.append((m["content"] + "<|im_end|>", True))
                pieces.append(("\n", False))
            else:
                pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
        return pieces

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        text = "".join(t for t, _ in self.segments(messages))
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + self.THINK
        return text
