"""``Qwen3_5Template``: ChatML as Qwen3/Qwen3.5 expect it, in non-thinking or thinking mode."""

from twinkle.template.base import Segment, Template
from twinkle.template.tools import qwen3_5_tool_messages
from twinkle.utils.errors import UserError


class Qwen3_5Template(Template):
    """ChatML written out here rather than taken from the tokenizer, so that every assistant turn
    is rendered the way the model produces it at inference (the tokenizer's own template drops
    the ``<think>`` block from past turns, which would make training and inference disagree).

    - ``enable_thinking`` unset or ``False`` (non-thinking mode): every assistant turn opens with
      the empty ``<think>`` block, as part of the prompt; the reply alone is supervised.
    - ``enable_thinking=True`` (thinking mode): the prompt ends at ``<|im_start|>assistant``; the
      model learns to write the ``<think>`` block itself, holding the reasoning given before
      ``</think>`` in the reply (empty when there is none).
    - ``use_chat_template=True`` renders with the tokenizer's own chat template instead, and
      ``False`` trains on plain text (see ``Template``)."""

    THINK = "<think>\n\n</think>\n\n"
    CHATML = ("<|im_start|>", "<|im_end|>")

    def _check_options(self) -> None:
        """Any ChatML tokenizer (Qwen's, SmolLM2's) renders Qwen's format; one whose vocabulary
        lacks the turn markers would spell them out as text the model never saw."""
        super()._check_options()
        if self.use_chat_template is not None:
            return
        vocab = self.tokenizer.get_vocab()
        missing = [t for t in self.CHATML if t not in vocab]
        if missing:
            raise UserError(
                f"Qwen3_5Template writes ChatML, but the tokenizer of {self.model_id or 'this model'} has no "
                f"{', '.join(missing)} token; use Template (the model's own chat template)"
            )

    @property
    def renders_with_tokenizer(self) -> bool:
        return self.use_chat_template is True

    def _assistant(self, content: str) -> list[Segment]:
        if not self.enable_thinking:
            return [
                ("<|im_start|>assistant\n" + self.THINK, False),
                (content + "<|im_end|>", True),
                ("\n", False),
            ]
        reasoning, answer = "", content
        if "</think>" in content:
            head, answer = content.split("</think>", 1)
            reasoning = head.split("<think>")[-1].strip("\n")
            answer = answer.lstrip("\n")
        block = f"<think>\n{reasoning}\n</think>\n\n"  # THINK when there is no reasoning
        return [("<|im_start|>assistant\n", False), (block + answer + "<|im_end|>", True), ("\n", False)]

    def segments(self, messages: list[dict[str, str]]) -> list[Segment]:
        if self.use_chat_template is not None:
            return super().segments(messages)
        pieces: list[Segment] = []
        for m in qwen3_5_tool_messages(messages):  # tools, tool calls and results as Qwen3.5 writes them
            if m["role"] == "assistant":
                pieces += self._assistant(m["content"])
            else:
                pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
        return pieces

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if self.use_chat_template is not None:
            return super().render(messages, add_generation_prompt)
        text = "".join(t for t, _ in self.segments(messages))
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if self.enable_thinking else self.THINK)
        return text
