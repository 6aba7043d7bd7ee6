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

A loss implements one entry point, and this module turns it into the other, once for all:

- a ``HeadLoss`` implements ``compute(view)``, the model's fast path; called as upstream calls a
  loss, ``loss(inputs, outputs)``, it runs ``compute`` on the rows view of ``inputs`` and
  ``outputs`` (``rows_view_of``) and returns ``{"loss", "num_tokens"}`` (``upstream_result``);
- a ``Loss`` of upstream's convention implements ``__call__(inputs, outputs)``; its
  ``compute(view)`` hands it the positions view as ``inputs``/``outputs`` and reads the result
  back into a ``LossOutput`` (``outputs_loss``).

A plain callable of upstream's convention is wrapped once into a ``Loss`` (``as_loss``, called
by ``model.set_loss``)."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.loss.output import IGNORE_INDEX, LossOutput, top_is_target
from twinkle.utils.errors import UserError

ROWS = "rows"
POSITIONS = "positions"
EMBEDDINGS = "embeddings"  # pooled rows, task='embedding' (twinkle.loss.infonce)
# the step's values upstream passes a loss as keywords (``HeadLoss.__call__``)
STEP_KEYWORDS = ("old_logps", "advantages", "ref_logps", "ref_outputs")


@dataclass
class LossView:
    """What the model computed for a loss. For ``rows``: ``targets`` ``(N,)`` and either
    ``hidden`` ``(N, hidden)`` with ``weight``/``bias``, or ``logits`` ``(N, vocab)`` (fp32 from
    the model), or (called as upstream calls a loss, with ``outputs["logps"]``) only ``logps``
    ``(N,)``; and
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
    # rows only, under Ulysses: the group whose ranks score the rows' other positions (a
    # ``SequenceGroup``; ``twinkle.loss.sequence_share``); None when the view holds every position
    sequence: Any = None

    @property
    def rows(self) -> int:
        """The batch's row count, the range of ``samples`` (0 without a batch)."""
        labels = self.batch.get("labels")
        return 0 if labels is None else int(labels.shape[0])


class Loss:
    """Base of the losses ``model.set_loss`` takes, in upstream's convention (``consumes =
    "positions"``): a subclass implements ``__call__(inputs, outputs)``. ``require_logps``: the
    model hands the targets' log-probabilities (``outputs["logps"]``); ``require_logits``: it
    hands the logits too (they are left out otherwise, as they are the largest tensor of the
    step). ``extra_inputs``: batch keys the loss reads (reference or old log-probs, advantages,
    pair indices, token weights). ``require_samples``: a ``rows`` loss gets each row's batch row
    (``LossView.samples``). ``sequence_parallel``: the loss is exact when a Ulysses group's ranks
    each score a share of the positions, with its per-token inputs and samples sliced alike
    (``LossView.sequence``: a loss over whole samples totals them over the group,
    ``twinkle.loss.sequence_share``); a loss without it runs under Ulysses only as a plain sum
    over tokens without extra inputs."""

    consumes = POSITIONS
    extra_inputs: tuple[str, ...] = ()
    require_samples = False
    sequence_parallel = False
    require_logits = False
    require_entropy = False
    require_logps = True

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(inputs, outputs)")

    def compute(self, view: LossView) -> LossOutput:
        """The model's call: ``self(inputs, outputs)`` on the positions view (``outputs_loss``)."""
        return outputs_loss(self, view)


class HeadLoss(Loss):
    """A loss over the supervised rows (``consumes = "rows"``): a subclass implements
    ``compute(view)``, from the hidden states and the head (``view.hidden``), or from already
    materialised logits of those rows (``view.logits``: models whose head post-processes its
    logits, or carries a LoRA). ``reduction`` (``sum`` or ``mean``) decides only the value the
    loss reports: training always uses the summed loss (``loss_sum``) divided by the supervised
    tokens of the whole global batch."""

    consumes = ROWS
    reduction = "sum"

    def compute(self, view: LossView) -> LossOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement compute(view)")

    def __call__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], **step: Any) -> dict[str, Any]:
        """Upstream's call (``rows_view_of`` says what ``inputs`` and ``outputs`` may hold):
        ``{"loss", "num_tokens"}`` as ``upstream_result``. The step's values may come as
        keywords, as upstream passes them (``old_logps=``, ``advantages=``, ``ref_logps=``, or
        ``ref_outputs=`` whose ``logps`` are the reference's); another keyword is refused."""
        # a loss's own inputs and the keywords it turns into them (``step_keywords``) come too
        allowed = (*STEP_KEYWORDS, *self.extra_inputs, *getattr(self, "step_keywords", ()))
        unknown = sorted(set(step) - set(allowed))
        if unknown:
            raise UserError(
                f"{self.name}: unexpected keyword(s) {unknown}; the step's values are {', '.join(allowed)}"
            )
        batch = dict(inputs)
        ref_outputs = step.pop("ref_outputs", None)
        if ref_outputs is not None and step.get("ref_logps") is None:
            step["ref_logps"] = ref_outputs.get("logps")
        batch.update({key: value for key, value in step.items() if value is not None})
        batch = self.upstream_batch(batch, outputs)
        return upstream_result(self, self.compute(rows_view_of(self, batch, outputs)))

    def upstream_batch(self, inputs: dict[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        """Upstream's call's ``inputs`` with the step's values merged in, before the view is made
        (a loss fills its own defaults here)."""
        return inputs


def upstream_result(loss: HeadLoss, out: LossOutput) -> dict[str, Any]:
    """``out`` in upstream's shape: with ``reduction="sum"`` the summed loss and its count (at
    least 1); with ``mean`` the mean and ``num_tokens`` 0, upstream's sign of a mean."""
    if loss.reduction == "sum":
        return {"loss": out.loss_sum, "num_tokens": max(1, int(out.num_tokens))}
    return {"loss": out.loss, "num_tokens": 0}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter FSDP2 shards (a ``DTensor``), else ``tensor``."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def rows_view_of(loss: Loss, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> LossView:
    """The rows view of upstream's ``inputs``/``outputs``: the positions whose label
    (``inputs["labels"]``, ``(B, L)``, already shifted) is not -100, in row-major order, each
    with its sample (``samples``). There the view holds the hidden states and the head when
    ``outputs["lm_head"]`` holds the head (``outputs["logits"]`` then holds the final hidden
    states: upstream's fused convention), else the targets' log-probabilities
    ``outputs["logps"]``, else the logits ``outputs["logits"]``; and each extra input the loss
    declares, from ``inputs`` (``extra_at_rows``)."""
    logps, logits, head = outputs.get("logps"), outputs.get("logits"), outputs.get("lm_head")
    if logps is None and logits is None:
        raise UserError(f"{loss.name} needs outputs['logps'] or outputs['logits']; pass one of them")
    given = logps if logps is not None else logits
    labels = torch.as_tensor(inputs["labels"]).to(given.device)
    mask = labels != IGNORE_INDEX
    view = LossView(
        targets=labels[mask], batch={**inputs, "labels": labels}, samples=mask.nonzero(as_tuple=True)[0]
    )
    if head is not None and logits is not None:
        bias = getattr(head, "bias", None)
        view.hidden, view.weight = logits[mask], _full(head.weight)
        view.bias = None if bias is None else _full(bias)
    elif logps is not None:
        view.logps = logps[mask]
    else:
        view.logits = logits[mask]
    dtype = logps.dtype if logps is not None else torch.float32
    view.extras = {
        name: extra_at_rows(loss, name, inputs.get(name), labels, mask, dtype) for name in loss.extra_inputs
    }
    return view


def extra_at_rows(
    loss: Loss, name: str, value: Any, labels: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An extra input's values at the ``mask``ed rows, as ``dtype``: ``value`` per label
    ``(B, L)``, per row ``(B,)`` or one list per row of the labelled positions' values only."""
    rows, length = labels.shape
    if value is None:
        raise UserError(
            f"{loss.name} needs inputs[{name!r}]; pass one value per label ({rows}, {length}) or per row ({rows},)"
        )
    tensor = torch.as_tensor(align_completion_values(name, value, labels, dtype))
    if tensor.dim() == 3 and tuple(tensor.shape[:2]) == (rows, length):  # several values per label
        return tensor.to(labels.device)[
            mask
        ]  # as given: ids stay integers, a float64 reference stays float64
    tensor = tensor.to(dtype)
    if tuple(tensor.shape) not in ((rows, length), (rows,)):
        raise UserError(
            f"inputs[{name!r}] has shape {tuple(tensor.shape)}, but the labels are {rows} x {length}; pass "
            f"one value per label ({rows}, {length}) or per row ({rows},)"
        )
    tensor = tensor.to(labels.device)
    return (tensor[:, None].expand(labels.shape) if tensor.dim() == 1 else tensor)[mask]


def align_completion_values(
    name: str, value: Any, labels: torch.Tensor, dtype: torch.dtype = torch.float32
) -> Any:
    """``value`` as a ``(B, L)`` tensor aligned with ``labels`` when it is one list per row of
    only the completion's values (ragged: the sampler's log-probs); anything else unchanged.
    A row whose list does not have one value per supervised label is a one-line error."""
    if torch.is_tensor(value) or not isinstance(value, Sequence) or isinstance(value, str):
        return value
    if not value or not all(isinstance(row, Sequence | torch.Tensor) for row in value):
        return value  # per-row scalars: the caller checks their shape
    rows, length = labels.shape
    if len(value) == rows and all(len(row) == length for row in value):
        return value  # already (B, L)
    if len(value) != rows:
        raise UserError(f"{name} has {len(value)} rows, but the batch has {rows}; pass one list per row")
    out = torch.zeros(labels.shape, dtype=dtype)
    for i, row in enumerate(value):
        where = (labels[i] != IGNORE_INDEX).nonzero(as_tuple=True)[0].cpu()
        if len(row) != where.numel():
            raise UserError(
                f"{name} row {i} has {len(row)} values, but that row's completion has {where.numel()} "
                "labelled tokens; pass the sampler's log-probs of that same sequence (one per token)"
            )
        out[i, where] = torch.as_tensor(row, dtype=dtype).reshape(-1)
    return out


def outputs_loss(loss_fn: Loss, view: LossView) -> LossOutput:
    """``loss_fn(inputs, outputs)``: ``inputs`` is the batch with each position's target as
    ``labels`` (-100 where none); ``outputs`` holds ``logps`` (unless ``loss_fn.require_logps``
    is False) and ``logits`` (if ``loss_fn.require_logits``), in fp32. A result with a non-zero
    ``num_tokens`` is a sum over that many tokens; otherwise (a bare scalar, or ``num_tokens``
    0) it is a mean over the supervised tokens, and its sum is the mean times their count, so
    training still takes the mean over every supervised token of the global batch."""
    targets, logits = view.targets, view.logits
    mask = targets != IGNORE_INDEX
    outputs: dict[str, Any] = {"logits": logits if loss_fn.require_logits else None}
    if loss_fn.require_logps:
        outputs["logps"] = view.logps
    result = loss_fn({**view.batch, "labels": targets}, outputs)
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not (torch.is_tensor(loss) and loss.numel() == 1):
        raise UserError(
            f"the loss {loss_fn.name} returned {type(result).__name__}; "
            "return a scalar tensor or {'loss': scalar tensor, 'num_tokens': ...}"
        )
    loss = loss.reshape(()).float()
    supervised = int(mask.sum())
    counted = result.get("num_tokens") if isinstance(result, Mapping) else None
    if counted is not None and int(counted) != 0:
        num_tokens, loss_sum = (int(counted) if supervised else 0), loss
    else:
        num_tokens, loss_sum = supervised, loss * supervised
    correct = top_is_target(logits[mask].detach(), targets[mask])
    return LossOutput(loss=loss, loss_sum=loss_sum, num_tokens=num_tokens, num_correct=correct)


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
        if fn.consumes not in (ROWS, POSITIONS, EMBEDDINGS):
            raise UserError(
                f"{fn.name}.consumes={fn.consumes!r}; use {ROWS!r}, {POSITIONS!r} or {EMBEDDINGS!r}"
            )
        return fn
    if not callable(fn):
        raise UserError(f"the loss {fn!r} is not callable; pass a loss name, class or callable")
    return UpstreamLoss(fn)
