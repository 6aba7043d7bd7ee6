"""What a sampler takes and returns: ``SamplingParams``, ``SampledSequence``, ``SampleResponse``.

Upstream's names and fields. ``SamplingParams`` checks its values when built, so a bad value
is one ``UserError`` line at the call that made it, not an error deep inside generation."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.utils.errors import UserError

StopReason = Literal["stop", "length"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Below this a draw is the argmax anyway, and logits divided by a far smaller temperature overflow
# fp32 to infinity, which no softmax survives.
MIN_TEMPERATURE = 1e-6


def _flag(help: str, rule: str, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """The metadata of a field the command line offers as a flag: its help, the rule its values
    follow (for the error message; ``SamplingParams`` itself checks them) and other flag names.
    ``twinkle.cli.post_training_args.SamplingArgs`` is made of exactly these fields."""
    return {"flag_help": help, "flag_rule": rule, "flag_aliases": aliases}


@dataclass
class SamplingParams:
    """How to sample.

    - ``max_tokens``: the most tokens generated per sequence (None: up to the model's maximum
      positions; 0: nothing is generated, the prompt is only scored, see ``prompt_logprobs``).
    - ``temperature``: 0 is greedy (the most likely token); otherwise logits are divided by it.
    - ``top_p`` in (0, 1]: sample among the most likely tokens whose probabilities add up to
      ``top_p``; ``top_k``: among the ``top_k`` most likely (-1 or 0: all).
    - ``num_samples``: sequences per prompt.
    - ``logprobs``: log-probabilities returned per generated token: the sampled token's always,
      then the most likely other tokens, ``logprobs`` entries in all (None or 0: the sampled
      token's only).
    - ``prompt_logprobs``: score the prompt too: ``SampleResponse.prompt_logprobs`` holds each
      prompt token's log-probability given the tokens before it, ``topk_prompt_logprobs`` the
      ``prompt_logprobs`` most likely tokens at each position (None or 0: not computed).
    - ``repetition_penalty``: > 1 makes tokens already in the prompt or the reply less likely
      (1: off).
    - ``seed``: the same seed, inputs and weights give the same samples (None: drawn from
      torch's global generator).
    - ``stop``: a string, strings, or token ids that end a sequence (the end-of-sequence tokens
      always do); ``include_stop_str_in_output``: whether ``decoded`` keeps the stop string."""

    max_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "tokens a completion may add; None = the script's default", ">= 0", ("max-new-tokens",)
        ),
    )
    temperature: float = field(
        default=1.0, metadata=_flag("sampling temperature; 0 = greedy", f"0 or >= {MIN_TEMPERATURE:g}")
    )
    top_p: float = field(
        default=1.0,
        metadata=_flag(
            "nucleus sampling: the smallest set of tokens with this much probability", "in (0, 1]"
        ),
    )
    top_k: int = field(
        default=-1, metadata=_flag("sample among the k most likely tokens; -1 or 0 = all", "an integer >= -1")
    )
    num_samples: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise UserError(
                f"SamplingParams(max_tokens={self.max_tokens!r}): max_tokens must be an integer >= 0 "
                "(0 scores the prompt without generating)"
            )
        if not _is_number(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise UserError(
                f"SamplingParams(temperature={self.temperature!r}): temperature must be 0 (greedy) or a "
                f"number >= {MIN_TEMPERATURE:g}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(
                f"SamplingParams(top_p={self.top_p!r}): top_p must be in (0, 1] (1 keeps every token)"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise UserError(
                f"SamplingParams(top_k={self.top_k!r}): top_k must be an integer >= 1, or -1 for all"
            )
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise UserError(
                f"SamplingParams(num_samples={self.num_samples!r}): num_samples must be an integer >= 1"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise UserError(
                f"SamplingParams(logprobs={self.logprobs!r}): logprobs must be an integer >= 0 or None"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise UserError(
                f"SamplingParams(prompt_logprobs={self.prompt_logprobs!r}): prompt_logprobs must be an "
                "integer >= 0 or None"
            )
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise UserError(
                f"SamplingParams(repetition_penalty={self.repetition_penalty!r}): repetition_penalty must "
                "be a number > 0 (1 is off)"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise UserError(f"SamplingParams(seed={self.seed!r}): seed must be an integer or None")
        self.stop_strings, self.stop_token_ids = _split_stop(self.stop)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """From a dict (``max_new_tokens`` is read as ``max_tokens``); an unknown key is an error."""
        values = dict(values)
        if "max_new_tokens" in values and "max_tokens" not in values:
            values["max_tokens"] = values.pop("max_new_tokens")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(
                f"SamplingParams: unknown key(s) {unknown}; valid keys: {', '.join(sorted(known))}"
            )
        return cls(**values)


def _split_stop(stop: Any) -> tuple[list[str], list[int]]:
    """``stop`` -> (stop strings, stop token ids)."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or isinstance(stop, bytes):
        raise UserError(
            f"SamplingParams(stop={stop!r}): stop must be a string, a list of strings or of token ids"
        )
    strings = [s for s in stop if isinstance(s, str)]
    ids = [s for s in stop if _is_int(s)]
    if len(strings) + len(ids) != len(stop) or "" in strings:
        raise UserError(
            f"SamplingParams(stop={list(stop)!r}): each stop must be a non-empty string or a token id"
        )
    return strings, ids


@dataclass
class SampledSequence:
    """One generated sequence.

    - ``tokens``: the generated token ids (an end-of-sequence token or the token that completed
      a stop string included: the model is trained on what it sampled);
    - ``logprobs``: per generated token, ``[(token_id, logprob), ...]``, the sampled token first
      (``SamplingParams.logprobs``); the log-probabilities of the model itself, at temperature
      1 and before top-k/top-p, i.e. what a training forward computes for the same tokens;
    - ``decoded``: the text of ``tokens`` without special tokens (cut before a stop string
      unless ``include_stop_str_in_output``);
    - ``stop_reason``: ``stop`` (end-of-sequence token, stop string or stop token) or
      ``length`` (``max_tokens`` or the model's maximum positions reached);
    - ``new_input_feature``: prompt plus completion as a training row (``input_ids``,
      ``labels`` -100 on the prompt and the tokens on the completion, ``attention_mask``,
      ``position_ids``, ``length``; the prompt row's other keys, such as ``user_data``; and
      ``messages``, the prompt's messages plus the reply as an assistant turn, when the prompt
      has messages: a reward reads them), ready for ``model.forward_backward(inputs=[...])``.
      With ``max_tokens=0`` nothing is generated: ``tokens`` is empty and the row is the scored
      prompt with its own labels (a conversation given as messages: its assistant replies).
    - ``routed_experts``: where the sampler records them (``enable_return_routed_experts``), the
      experts each token ran through, ``(tokens, moe_layers, top_k)`` over the prompt and every
      sampled token but the last (which the model never ran); also in ``new_input_feature``."""

    tokens: list[int]
    logprobs: list[list[tuple[int, float]]]
    decoded: str
    stop_reason: StopReason
    new_input_feature: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None


@dataclass
class SampleResponse:
    """The sequences sampled for one prompt (``num_samples`` of them) and the prompt's tokens.

    With ``SamplingParams(prompt_logprobs=k)``: ``prompt_logprobs[i]``, the log-probability of
    prompt token ``i`` given the tokens before it, and ``topk_prompt_logprobs[i]``, the ``k`` most
    likely tokens at position ``i`` as ``[(token_id, logprob), ...]`` in descending order (both
    None at position 0, which nothing predicts); otherwise both are None."""

    sequences: list[SampledSequence]
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
