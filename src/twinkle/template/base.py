"""``Template``: the tokenizer's own chat template, with labels on assistant tokens only."""

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.template.rows import (
    IGNORE_INDEX,
    columns_to_rows,
    concat_reply,
    feature_of,
    messages_of,
    rows_to_columns,
    tokenizer_of,
    without_empty_reply,
)
from twinkle.utils.errors import UserError

TRUNCATION_STRATEGIES = ("raise", "left", "right", "delete")

Segment = tuple[str, bool]  # (text, supervised)


class TokenIds(list):
    """A row's ``input_ids`` or ``labels`` from ``Template.encode``: a plain list that also
    answers ``tolist()``, because upstream's encode returns numpy arrays and scripts written
    against it call ``feature['input_ids'].tolist()``; everything a list does still works."""

    def tolist(self) -> list[int]:
        return list(self)


class Template:
    """Encode chat messages with ``tokenizer.apply_chat_template``.

    ``Template(model_id)``: the tokenizer of a model id or folder, resolved by ``twinkle.hub``
    (None: the bundled model); an already loaded tokenizer is taken as it is.

    The conversation is rendered once per assistant turn to find where each reply starts and
    ends; each piece is tokenised on its own so the label mask falls exactly on token borders.
    System, user and template tokens get label ``-100``; the assistant's reply and everything
    the template writes after it up to the next turn (its end-of-turn tokens, a newline) are
    supervised.

    - ``enable_thinking``: handed to the chat template (Qwen3-style templates read it: ``False``
      writes the empty ``<think>`` block into the prompt). ``None`` leaves the template's default;
      a value the chat template never reads is an error rather than a silent no-op.
    - ``default_system``: the system message of every conversation that has none.
    - ``use_chat_template``: ``None`` is the class's own rendering (here the tokenizer's chat
      template); ``True`` insists on the tokenizer's chat template; ``False`` trains on plain text
      (pre-training): each row is one message whose text is supervised as a whole."""

    def __init__(
        self,
        model_id: Any = None,
        use_chat_template: bool | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
        default_system: str | None = None,
        enable_thinking: bool | None = None,
    ):
        if truncation_strategy not in TRUNCATION_STRATEGIES:
            raise UserError(
                f"--truncation-strategy: {truncation_strategy!r} is not one of {', '.join(TRUNCATION_STRATEGIES)}"
            )
        if not isinstance(max_length, int) or max_length < 1:
            raise UserError(f"--max-length must be at least 1, got {max_length}")
        self.model_id, self.tokenizer = tokenizer_of(model_id)
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.enable_thinking = enable_thinking
        self.default_system = default_system
        self.use_chat_template = use_chat_template
        self._check_options()

    @property
    def processor(self) -> Any:
        """What turns text into tokens; for a text model, the tokenizer itself."""
        return self.tokenizer

    @property
    def renders_with_tokenizer(self) -> bool:
        """Whether conversations go through ``tokenizer.apply_chat_template``."""
        return self.use_chat_template is not False

    def _check_options(self) -> None:
        chat_template = getattr(self.tokenizer, "chat_template", None)
        if self.use_chat_template is False:
            for name in ("enable_thinking", "default_system"):
                if getattr(self, name) is not None:
                    raise UserError(
                        f"{name} needs a chat template, but use_chat_template=False trains on plain text; "
                        f"drop {name} or use the chat template"
                    )
            return
        if not self.renders_with_tokenizer:
            return
        if self.use_chat_template and not chat_template:
            raise UserError(
                "use_chat_template=True: the tokenizer has no chat_template; use a chat model, "
                "or pass use_chat_template=False to train on plain text"
            )
        if self.enable_thinking is not None and chat_template and "enable_thinking" not in str(chat_template):
            raise UserError(
                f"enable_thinking={self.enable_thinking}: this tokenizer's chat template has no thinking "
                "switch; leave enable_thinking unset or pick a template that has one (e.g. Qwen3_5Template)"
            )

    def settings(self) -> dict[str, Any]:
        """Everything besides the tokenizer that decides how a row is encoded (for cache keys)."""
        cls = type(self)
        return {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "max_length": self.max_length,
            "truncation_strategy": self.truncation_strategy,
            "enable_thinking": self.enable_thinking,
            "default_system": self.default_system,
            "use_chat_template": self.use_chat_template,
        }

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(
                "the tokenizer has no chat template; use a chat model or pick one with --template-cls"
            )
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    def with_default_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.default_system is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.default_system}, *messages]

    def segments(self, messages: list[dict[str, str]]) -> list[Segment]:
        """Split the rendered conversation into unsupervised and supervised (assistant) pieces."""
        if self.use_chat_template is False:
            if len(messages) != 1:
                raise UserError(
                    f"use_chat_template=False trains on plain text: each row needs exactly one message "
                    f"holding the text, got {len(messages)}"
                )
            return [(messages[0]["content"], True)]
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

    def tokenize(self, messages: list[dict[str, str]], skip_replies: int = 0) -> tuple[list[int], list[int]]:
        """``input_ids`` and ``labels``; the first ``skip_replies`` supervised pieces get label
        -100 too (a preference pair's prompt may hold earlier assistant turns: only the final
        reply is compared)."""
        # Plain text is a document: it gets the tokenizer's own special tokens (a BOS, say).
        special = self.use_chat_template is False
        input_ids: list[int] = []
        labels: list[int] = []
        for text, supervised in self.segments(messages):
            ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
            input_ids += ids
            if supervised and skip_replies > 0:
                supervised, skip_replies = False, skip_replies - 1
            labels += ids if supervised else [IGNORE_INDEX] * len(ids)
        return input_ids, labels

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens of a prompt: the conversation rendered with its generation prompt (plain
        text: the one message's text with the tokenizer's own special tokens). A trailing
        assistant turn without text is the turn the generation prompt opens."""
        messages = without_empty_reply(messages)
        if self.use_chat_template is False:
            self.segments(messages)  # the one-message check
            return self.tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
        text = self.render(self.with_default_system(messages), add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(
        self, trajectory: Any, add_generation_prompt: bool = False, index: int | None = None
    ) -> dict[str, Any] | None:
        """Tokenise and truncate one conversation; ``None`` means the row is dropped (``delete``).

        ``trajectory``: a ``Trajectory`` (``{'messages': [...], ...}``), whose other keys
        (``messages`` included, for a reward to read) are kept in the row returned, or the list of
        messages alone. ``add_generation_prompt=True`` encodes a prompt for a sampler: the
        assistant's turn opened after the last message, every label ``-100``."""
        messages, carried = messages_of(trajectory)
        if add_generation_prompt:
            input_ids = self.prompt_ids(messages)
            labels = [IGNORE_INDEX] * len(input_ids)
        else:
            input_ids, labels = self.tokenize(self.with_default_system(messages))
        feature = self._truncate(input_ids, labels, index)
        if feature is None:
            return None
        feature = {
            **feature,
            "input_ids": TokenIds(feature["input_ids"]),
            "labels": TokenIds(feature["labels"]),
        }
        return feature if carried is None else {**carried, **feature}

    def batch_encode(
        self, trajectories: Any, add_generation_prompt: bool = False
    ) -> list[dict[str, Any]] | dict[str, list[Any]]:
        """``encode`` over a list of trajectories (a list of rows back, without the rows
        ``truncation_strategy='delete'`` drops) or over columns (``{'messages': [...], ...}``,
        columns back)."""
        if isinstance(trajectories, Mapping):
            rows = columns_to_rows(trajectories)
            return rows_to_columns(self.batch_encode(rows, add_generation_prompt))
        if isinstance(trajectories, str | bytes) or not isinstance(trajectories, Sequence):
            raise UserError(
                f"batch_encode got {type(trajectories).__name__}; pass a list of trajectories "
                "({'messages': [...]}) or columns"
            )
        out = (self.encode(t, add_generation_prompt, index=i) for i, t in enumerate(trajectories))
        return [row for row in out if row is not None]

    def concat_input_feature(self, prompt: dict[str, Any], new_tokens: list[int]) -> dict[str, Any]:
        """A prompt's encoded row followed by ``new_tokens`` (a sampled reply): the prompt keeps
        its labels, the reply is supervised, and ``messages``, when the row has them, gain the
        reply as an assistant turn (what a reward reads)."""
        return concat_reply(prompt, new_tokens, self.decode(new_tokens, skip_special_tokens=True))

    def decode(
        self,
        token_ids: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Text of ``token_ids`` (a list or a 1-D tensor)."""
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
        )

    def batch_decode(self, token_ids: Any, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in token_ids]

    def _truncate(self, input_ids: list[int], labels: list[int], index: int | None) -> dict[str, Any] | None:
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
        return feature_of(input_ids, labels)
