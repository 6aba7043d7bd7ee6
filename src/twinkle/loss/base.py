"""The loss protocol: what ``model.set_loss`` takes and what the model hands a loss.

A loss declares what it consumes (``Loss.consumes``) and which extra batch tensors it needs
(``Loss.extra_inputs``); the model computes that, once, into a ``LossView`` and calls
``loss.compute(view)``, which returns a ``twinkle.loss.LossOutput`` (the loss, its sum over
tokens, the token count and the count of correctly predicted tokens for the accuracy metric).

- ``consumes = "rows"`` (``HeadLoss``): the final hidden states of the supervised positions,
  the output head's weight and bias and the targets, so the ``(batch, seq, vocab)`` logits are
  never built. Where the head cannot be split off (it post-processes its logits or carries a
  LoRA) the view holds those rows' logits instead. An extra input is a ``(batch, seq)`` tensor
  aligned with ``labels`` or a ``(batch,)`` per-sample one; the view holds its values at the
  supervised rows (``view.extras``), in the same order, packed or not. With
  ``require_samples`` the view also holds each supervised row's batch row (``view.samples``), in
  the batch's row-major order whether the batch runs packed or not (a loss over whole samples:
  the preference losses of ``twinkle.loss.preference``).
- ``consumes = "positions"`` (``Loss``; upstream's convention ``loss(inputs, outputs) ->
  {"loss", "num_tokens"}``): the padded batch's fp32 logits and the targets' log-probabilities
  (``require_logps``); ``inputs["labels"]`` holds each position's target (already shifted,
  ``-100`` where none), every other batch tensor (extra inputs included) is passed as it is.

A plain callable of upstream's convention is wrapped once into a ``Loss`` (``as_loss``, called
by ``model.set_loss``). ``HeadLoss`` subclasses can still be called directly either way: a
tensor first argument is the model's ``head_loss`` convention, a mapping upstream's."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.utils.errors import UserError

ROWS = "rows"
POSITIONS = "positions"


@dataclass
class LossView:
    """What the model computed for a loss. For ``rows``: ``targets`` ``(N,)`` and either
    ``hidden`` ``(N, hidden)`` with ``weight``/``bias``, or ``logits`` ``(N, vocab)`` fp32; and
    ``extras`` (name -> ``(N,)``), ``samples`` (``(N,)`` batch rows, None unless required) and
    ``batch``. For ``positions``: ``targets`` ``(B, L)`` (-100 where none), ``logits``
    ``(B, L, vocab)`` fp32, ``logps`` ``(B, L)`` (None unless required) and ``batch``."""

    targets: torch.Tensor
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logps: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    batch: Mapping[str, Any] = field(default_factory=dict)
    samples: torch.Tensor | None = None
    # rows only: each row's position in the packed row when a scored shared prefix repeats some
    # (rows at one position hold the same hidden state and target); None otherwise
    positions: torch.Tensor | None = None


class Loss:
    """Base of the losses ``model.set_loss`` takes, in upstream's convention (``consumes =
    "positions"``). ``require_logps``: the model hands the targets' log-probabilities
    (``outputs["logps"]``); ``require_logits``: it hands the logits too (they are left out
    otherwise, as they are the largest tensor of the step). ``extra_inputs``: batch keys the loss
    reads (reference or old log-probs, advantages, pair indices, token weights).
    ``require_samples``: a ``rows`` loss gets each row's batch row (``LossView.samples``)."""

    consumes = POSITIONS
    extra_inputs: tuple[str, ...] = ()
    require_samples = False
    require_logits = False
    require_entropy = False
    require_logps = True

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(inputs, outputs)")

    def compute(self, view: LossView) -> Any:
        from twinkle.loss.upstream import outputs_loss  # cross_entropy imports this module

        return outputs_loss(self, view)


class UpstreamLoss(Loss):
    """A plain callable ``fn(inputs, outputs)`` as a ``Loss``; its ``require_*`` and
    ``extra_inputs`` attributes, when it has them, are honoured."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)  # how the run's config names it
        for attr in ("require_logits", "require_entropy", "require_logps", "extra_inputs"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))

    @property
    def name(self) -> str:
        return self.__name__

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any) -> Any:
        return self.fn(inputs, outputs, **kwargs)


def as_loss(fn: Any) -> Loss:
    """``fn`` itself if it is a ``Loss``, else a callable wrapped into one."""
    if isinstance(fn, Loss):
        if fn.consumes not in (ROWS, POSITIONS):
            raise UserError(f"{fn.name}.consumes={fn.consumes!r}; use {ROWS!r} or {POSITIONS!r}")
        return fn
    if not callable(fn):
        raise UserError(f"the loss {fn!r} is not callable; pass a loss name, class or callable")
    return UpstreamLoss(fn)


class HeadLoss(Loss):
    """A token loss the model computes from hidden states and the head (``head_loss``), or from
    already materialised logits of the supervised positions (``logits_loss``: models whose head
    post-processes its logits, or carries a LoRA). ``reduction`` (``sum`` or ``mean``) decides
    only the value the loss reports: training always uses the summed loss (``loss_sum``)
    divided by the supervised tokens of the whole global batch."""

    consumes = ROWS
    reduction = "sum"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and torch.is_tensor(args[0]):
            return self.head_loss(*args, **kwargs)
        return self.from_outputs(*args, **kwargs)

    def compute(self, view: LossView) -> Any:
        if view.hidden is not None:
            return self.head_loss(view.hidden, view.weight, view.targets, view.bias)
        return self.logits_loss(view.logits, view.targets)

    def head_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> Any:
        raise NotImplementedError

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> Any:
        raise NotImplementedError

    def from_outputs(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict:
        raise NotImplementedError
