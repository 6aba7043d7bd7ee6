"""``ModelOutputs``: what ``forward_only`` returns, and the labels' log-probabilities it holds.

``outputs["logps"]`` is ``(B, L)`` aligned with the batch's ``labels``: the log-probability the
model gives each label from the position before it, 0 where the label is -100 or has no
prediction (the first position, pads). It is what a reference pass hands a loss
(``forward_backward(inputs, ref_outputs=outputs)``, ``twinkle.loss.dpo``).

The evaluation computes the head only on the supervised positions (``twinkle.model.forward``);
their log-probabilities are one more head product on those rows, so on that path they are
computed on first read (the view's hidden rows are kept until then), and never when nobody reads
them. Where the rows' logits or log-probabilities already exist (a preference loss computed
them, the positions path, a LoRA mode) or the head weight is a gathered copy (FSDP2: keeping it
would hold the whole head), they are placed at once."""

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.loss.base import HeadLoss, LossView
from twinkle.loss.cross_entropy import LossOutput
from twinkle.loss.preference import row_logps
from twinkle.model.packing import shifted_targets
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError


class ModelOutputs(Mapping):
    """``{"loss": mean loss (float), "num_tokens": the loss's count (int), "logps": (B, L)}``;
    ``float(outputs)`` is the loss. ``logps`` may be computed on first read (then kept). A pass
    that recorded its routes (``RouterReplayAction.RECORD``) also holds ``routed_experts``
    ``(B, L, moe_layers, top_k)`` (``twinkle.model.router_replay``)."""

    def __init__(
        self,
        loss: float,
        num_tokens: int,
        logps: torch.Tensor | Callable[[], torch.Tensor],
        routed_experts: torch.Tensor | None = None,
    ):
        self._values: dict[str, Any] = {"loss": loss, "num_tokens": num_tokens, "logps": logps}
        if routed_experts is not None:
            self._values["routed_experts"] = routed_experts

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if key == "logps" and callable(value):
            value = self._values["logps"] = value()
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __float__(self) -> float:
        return float(self._values["loss"])

    def __repr__(self) -> str:
        logps = self._values["logps"]
        shown = "(computed on read)" if callable(logps) else f"tensor{tuple(logps.shape)}"
        return f"ModelOutputs(loss={self._values['loss']!r}, num_tokens={self._values['num_tokens']}, logps={shown})"


def place_targets(values: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Values of the supervised positions (row-major order, ``(N,)``) -> ``(B, L)`` at the
    positions that predict them (aligned with the shifted labels), 0 elsewhere."""
    targets = shifted_targets(batch["labels"], batch["attention_mask"])
    placed = torch.zeros(targets.shape, dtype=values.dtype, device=values.device)
    placed[(targets != IGNORE_INDEX).to(values.device)] = values
    return placed


def place_rows(values: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``place_targets``, then each value moved to its label's own position."""
    return align_to_labels(place_targets(values, batch))


def align_to_labels(per_target: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` values at each position's target (its next label) -> at the label itself."""
    aligned = torch.zeros_like(per_target)
    aligned[:, 1:] = per_target[:, :-1]
    return aligned


def label_logps(
    out: Any, view: LossView, batch: Mapping[str, torch.Tensor], lazy: bool
) -> torch.Tensor | Callable[[], torch.Tensor]:
    """The labels' log-probabilities of the pass that computed ``out`` from ``view``: a tensor,
    or with ``lazy`` and only the hidden rows at hand, a function computing it."""
    rows = getattr(out, "logps", None)  # a preference loss's, already computed
    if rows is not None:
        return place_rows(rows.detach(), batch)
    if view.targets.dim() == 2:  # the positions view: (B, L) targets
        logps = view.logps
        if logps is None:
            logps = -F.cross_entropy(view.logits.transpose(1, 2), view.targets.clamp(min=0), reduction="none")
        return align_to_labels(logps.masked_fill(view.targets == IGNORE_INDEX, 0.0))
    if view.hidden is None or not lazy:
        return place_rows(row_logps(view).detach(), batch)
    hidden, weight, bias, targets = view.hidden, view.weight, view.bias, view.targets

    def compute() -> torch.Tensor:
        with torch.no_grad():
            return place_rows(
                row_logps(LossView(targets=targets, hidden=hidden, weight=weight, bias=bias)), batch
            )

    return compute


class LogpsOnly(HeadLoss):
    """Stands in for a loss whose declared inputs a ``forward_only`` call lacks (a reference or
    old-policy pass): no loss (NaN), only the rows the labels' log-probabilities come from."""

    def __init__(self, loss_name: str):
        self.loss_name = loss_name

    @property
    def name(self) -> str:
        return self.loss_name

    def compute(self, view: LossView) -> LossOutput:
        nan = torch.full((), float("nan"))
        return LossOutput(nan, nan, int(view.targets.numel()), torch.zeros((), dtype=torch.long))


def metric_logps(out: Any, inputs: Mapping[str, Any], targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the added metrics read besides the counts, ``(B, L)`` aligned with the shifted labels
    they get (``targets``), on their device: ``logps`` when the loss computed the rows'
    log-probabilities (the preference losses), ``ref_logps`` when the batch carried them."""
    found = {}
    rows = getattr(out, "logps", None)
    if rows is not None:
        found["logps"] = place_targets(rows.detach(), inputs).to(targets.device)
    ref = inputs.get("ref_logps")
    if torch.is_tensor(ref) and ref.dim() == 2:
        ref = ref.detach().to(targets.device, torch.float32)
        shifted = torch.cat([ref[:, 1:], torch.zeros_like(ref[:, :1])], dim=1)
        found["ref_logps"] = shifted.masked_fill(targets == IGNORE_INDEX, 0.0)
    return found


_NOT_KEPT = (
    "the training step's logps were not kept here{why}; read them from "
    "model.forward_only(inputs=batch)['logps']"
)


class StepOutputs(float):
    """What ``forward_backward`` returns: the mean loss as a float (scripts compare, add, log and
    stack it), which also carries upstream's outputs: ``outputs.get("loss")``, ``.get("num_tokens")``
    and ``.get("logps")`` (``(B, L)`` aligned with the batch's labels, as ``ModelOutputs``'s;
    computed on first read where the step kept its hidden rows). A script may set entries
    (``outputs["logps"] = ...``), as upstream's outputs dict allows; the float stays the loss.

    Entries are read with ``get``, as upstream's scripts read them: a float that could be indexed
    (``outputs["logps"]``) would be a sequence to torch and numpy, and ``torch.tensor(losses)``
    of a list of losses would fail.

    It leaves its process (pickled: Ray) with what it holds. ``ship_logps`` (a step whose loss
    takes extra inputs: RL and preference scripts read the logps) computes them as it leaves;
    otherwise logps not yet computed stay behind, and reading them there says so."""

    def __new__(
        cls, loss: float, num_tokens: int, logps: Any = None, ship_logps: bool = False
    ) -> "StepOutputs":
        out = super().__new__(cls, loss)
        out._values = {"loss": float(loss), "num_tokens": num_tokens, "logps": logps}
        out._ship_logps = ship_logps
        return out

    def __reduce__(self) -> tuple:
        logps = self._values["logps"]
        if callable(logps) and self._ship_logps:
            try:
                logps = self.get("logps")
            except UserError:  # a step that did not keep them: reading says so on the other side
                logps = None
        values = {k: v for k, v in self._values.items() if k not in ("loss", "num_tokens", "logps")}
        kept = None if callable(logps) else logps
        return (_rebuilt, (float(self), self._values["num_tokens"], kept, values))

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._values:
            return default
        value = self._values[key]
        if key == "logps":
            if value is None:
                raise UserError(_NOT_KEPT.format(why=" (they stay in the process that ran the step)"))
            if callable(value):
                value = self._values["logps"] = value()
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def keys(self) -> Any:
        return self._values.keys()

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self.get(k)) for k in self._values]

    def __repr__(self) -> str:
        return f"StepOutputs(loss={float(self)!r}, num_tokens={self._values['num_tokens']})"


def _rebuilt(loss: float, num_tokens: int, logps: Any, values: dict[str, Any]) -> StepOutputs:
    out = StepOutputs(loss, num_tokens, logps)
    out._values.update(values)
    return out


def refused_logps(why: str) -> Callable[[], torch.Tensor]:
    """A ``logps`` entry that says, when read, why the step did not keep them."""

    def refuse() -> torch.Tensor:
        raise UserError(_NOT_KEPT.format(why=why))

    return refuse


def joined_logps(parts: list[Any]) -> Any:
    """The ``logps`` of a batch run in parts of rows (``micro_batch_size``): each part's, computed
    on read, stacked in row order."""

    def join() -> torch.Tensor:
        tensors = [p() if callable(p) else p for p in parts]
        return torch.cat(tensors, dim=0)

    return join


def reads_logps(loss: Any) -> bool:
    """Whether the scripts of ``loss`` read a step's logps: a loss with extra inputs (RL,
    preference) or one that needs the samples."""
    return bool(getattr(loss, "extra_inputs", ()) or getattr(loss, "require_samples", False))


def step_logps(
    out: Any, view: LossView, batch: Mapping[str, torch.Tensor], loss: Any, distributed: bool
) -> Any:
    """The ``logps`` entry of a training step's outputs, without the step's graph: computed on
    read from the kept hidden rows in one process; under FSDP2 (where the head weight of the view
    is a gathered copy, too large to keep) computed now for a loss with extra inputs (RL,
    preference: the scripts that read them), and refused on read for a plain cross-entropy step,
    whose speed must not pay for a head product nobody reads."""
    detached = LossView(
        targets=view.targets,
        hidden=None if view.hidden is None else view.hidden.detach(),
        weight=view.weight,
        bias=view.bias,
        logits=None if view.logits is None else view.logits.detach(),
        logps=None if view.logps is None else view.logps.detach(),
    )
    if distributed and view.hidden is not None and getattr(out, "logps", None) is None:
        if not reads_logps(loss):
            return refused_logps(" (under FSDP a cross-entropy step does not run the head for them)")
    with torch.no_grad():
        return label_logps(out, detached, batch, lazy=not distributed)
