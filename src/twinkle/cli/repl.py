"""``twinkle chat`` without ``--prompt``: a multi-turn conversation.

On a terminal it is an interactive loop: each reply streams token by token
(``transformers.TextStreamer``) and joins the history, so the next question sees the whole
conversation; ``/reset`` forgets it, ``/exit`` (or end of input) leaves. With stdin not a
terminal (a pipe, a file) each line is one question of the same conversation, and each reply
prints once it is complete."""

import sys
from typing import TextIO

import torch

from twinkle.cli.chat import check_max_new_tokens, load_for_chat
from twinkle.preprocessor.self_cognition import SYSTEM_PROMPT

HELP = "type a message; /reset forgets the conversation, /exit leaves"


class Conversation:
    """The history of one chat and the greedy generation of the next reply."""

    def __init__(self, model, tokenizer, template, system: str | None, max_new_tokens: int):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.system = system or SYSTEM_PROMPT
        self.max_new_tokens = max_new_tokens
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]

    @torch.no_grad()
    def reply(self, prompt: str, stream: TextIO | None = None) -> str:
        """The reply to ``prompt`` given the history; streamed to ``stream`` when given."""
        from transformers import TextStreamer

        self.messages.append({"role": "user", "content": prompt})
        text = self.template.render(self.messages, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        streamer = None
        if stream is not None:
            streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
            streamer.on_finalized_text = lambda chunk, stream_end=False: print(
                chunk, end="" if not stream_end else "\n", file=stream, flush=True
            )
        out = self.model.generate(
            **ids, max_new_tokens=self.max_new_tokens, do_sample=False, streamer=streamer
        )
        answer = self.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def run_repl(
    model_id: str | None,
    adapter: str | None,
    system: str | None,
    max_new_tokens: int,
    template_cls: str,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    from twinkle.template import get_template

    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    check_max_new_tokens(max_new_tokens)
    model, tokenizer = load_for_chat(model_id, adapter)
    chat = Conversation(model, tokenizer, get_template(template_cls, tokenizer), system, max_new_tokens)
    interactive = stdin.isatty()
    if interactive:
        print(HELP, file=stdout, flush=True)
    while True:
        if interactive:
            print(">>> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:  # end of input
            if interactive:
                print(file=stdout)
            return 0
        prompt = line.strip()
        if not prompt:
            continue
        if prompt in ("/exit", "/quit"):
            return 0
        if prompt == "/reset":
            chat.reset()
            print("(conversation reset)", file=stdout, flush=True)
            continue
        if interactive:
            chat.reply(prompt, stream=stdout)
        else:
            print(f"> {prompt}\n{chat.reply(prompt)}\n", file=stdout, flush=True)
