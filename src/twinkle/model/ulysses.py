"""Ulysses sequence parallelism in ``TransformersModel`` (``DeviceMesh(ulysses_size=N)``).

The N ranks of a group read the same rows. Each runs the ``rank``-th of N contiguous shares of
the positions (the packed row, or every row of a padded batch; the sequence padded to a multiple
of N with tokens that carry no target) through the layers, with the position ids of the whole
sequence, so rotary embeddings see each token's own position. Attention all-to-alls heads for
positions (``twinkle.kernel.attention.ulysses``): a packed row's samples attend exactly as in one
process, as the gathered row has the whole row's ``Segments``.

Each rank computes the loss of its own positions' targets; the shares are disjoint, so the
step's reduction over every rank (token counts and gradients, ``optimizer_step``) gives the mean
over the global batch's supervised tokens, as without Ulysses. A loss's per-token inputs (old and
reference log-probabilities, advantages) and each position's sample are sliced as the targets
are (``local_view``), and so are the routes of routing replay (``routed_experts``): each rank
replays its own positions' routes, and a recording forward gathers the shares' routes back into
whole rows, which every rank returns (``twinkle.model.router_replay``). A loss over whole
samples (GRPO's completion means, DPO's pair sums) totals its per-sample sums over the group and
counts its value once (``twinkle.loss.sequence_share``); the losses that do declare
``sequence_parallel``. Any other loss with per-token inputs or over whole samples, and a loss of
upstream's positions convention (it takes whole rows' logits), is refused in one line.

What the model refuses when it is built, in one line each (before the weights load where the
model is a local folder): heads (query or key/value) that N does not divide; hybrid
linear-attention families, whose recurrent state runs across the whole sequence; families whose
attention does not run through Hugging Face's attention interface on per-head q, k, v with
positions from ``position_ids`` (``PACKABLE_MODEL_TYPES``), and ``eager`` attention. At the first
step: the losses above, and ``task='embedding'`` (``twinkle.model.embedding``)."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from twinkle.distributed.mesh import DeviceMesh
from twinkle.distributed.sequence_parallel import SequenceGroup, gather_rows, sequence_group
from twinkle.kernel.attention.packed import Segments
from twinkle.kernel.attention.ulysses import UlyssesCall, enable_ulysses_attention
from twinkle.loss.base import POSITIONS, Loss, LossView
from twinkle.model.packing import PACKABLE_MODEL_TYPES
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

ATTRIBUTE = "_twinkle_ulysses"
# linear-attention layers (Gated DeltaNet) carry a state from each position to the next
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


class Ulysses:
    """A model's Ulysses group and the per-forward bookkeeping that puts the ranks' rows back in
    the whole batch's order (``whole_view``)."""

    def __init__(self, group: SequenceGroup):
        self.group = group
        self._ordinals: torch.Tensor | None = None  # this rank's scored rows' places in the whole list
        self._gather: torch.Tensor | None = None
        # the last share: the forward's rows and length (before padding), and this rank's positions
        self.span: tuple[int, int, int, int] | None = None

    @property
    def size(self) -> int:
        return self.group.size

    def check_loss(self, loss: Loss) -> None:
        """One line for a loss the ranks cannot compute from their shares of the positions: a
        rows loss over whole samples or with per-token inputs that does not declare
        ``sequence_parallel`` (``twinkle.loss.base``), or one of upstream's positions convention."""
        why = None
        if loss.consumes == POSITIONS:
            why = "it takes the (batch, sequence) logits of whole rows (upstream's positions convention)"
        elif getattr(loss, "sequence_parallel", False):
            return
        elif loss.require_samples:
            why = "it combines the tokens of whole samples"
        elif loss.extra_inputs:
            why = f"it reads per-token inputs ({', '.join(loss.extra_inputs)})"
        if why is not None:
            raise UserError(
                f"ulysses_size={self.size}: each rank computes the loss of its share of the positions, so "
                f"the loss must be a sum over tokens or declare sequence_parallel; {loss.name} is not ({why}); "
                "use ulysses_size=1"
            )

    def share(
        self,
        inputs: dict[str, Any],
        targets_2d: torch.Tensor,
        mask: Any,
        gather: torch.Tensor | None,
    ) -> tuple[dict[str, Any], torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """This rank's share of the forward: its inputs (with the ``twinkle_ulysses`` call), its
        targets ``(B, L / N)``, its scored positions (rows, columns within the share) in the
        whole batch's row-major order, and its part of ``gather`` (columns within the share)."""
        size, rank = self.group.size, self.group.rank
        rows, length = inputs["input_ids"].shape
        pad = -length % size
        segments = inputs.get("twinkle_segments")
        if pad:
            inputs, segments = _padded(inputs, segments, pad)
            targets_2d = F.pad(targets_2d, (0, pad), value=IGNORE_INDEX)
        share = (length + pad) // size
        start, end = rank * share, (rank + 1) * share
        self.span = (rows, length, start, end)
        # the scored positions as (row, column), in the order the loss lists them
        if isinstance(mask, tuple):
            cols = mask[1]
            scored_rows = torch.zeros_like(cols)
        else:
            scored_rows, cols = mask.nonzero(as_tuple=True)
        mine = (cols >= start) & (cols < end)
        self._ordinals = mine.nonzero().squeeze(1)
        self._gather = gather
        local = {k: inputs[k][:, start:end] for k in ("input_ids", "position_ids", "attention_mask")}
        if segments is not None:
            local["twinkle_segments"] = segments
        key_mask = None if segments is not None else inputs["attention_mask"]
        local["twinkle_ulysses"] = UlyssesCall(self.group, key_mask)
        local_gather = None if gather is None else gather[mine] - start
        return local, targets_2d[:, start:end], (scored_rows[mine], cols[mine] - start), local_gather

    def local_view(self, view: LossView) -> LossView:
        """``view`` with this rank's share of its per-token inputs and samples (read for the whole
        batch, in its row-major order, as the targets before ``share``) and the group, which a loss
        over whole samples totals its per-sample sums over."""
        mine = self._ordinals
        extras = {name: value[mine.to(value.device)] for name, value in view.extras.items()}
        samples = None if view.samples is None else view.samples[mine.to(view.samples.device)]
        return dataclasses.replace(view, extras=extras, samples=samples, sequence=self.group)

    def whole(self, out: Any, view: LossView, loss: Loss, training: bool) -> tuple[Any, LossView]:
        """What ``twinkle.model.forward.loss_and_view`` returns under Ulysses: ``out`` and, where
        a step's log-probabilities are read, the whole batch's view (``whole_view``). The rows'
        log-probabilities a preference loss keeps are gathered alike and kept on the group's first
        rank only: the added metrics that read them (``DPOMetric``) then count each row once, and
        the other ranks' step logps come from the whole view. A training step over hidden
        rows of a loss without extra inputs or samples keeps its own view: its logps are not read
        (``twinkle.model.outputs.step_logps``), so the hidden rows are not gathered."""
        reads = bool(loss.extra_inputs or loss.require_samples)
        if training and view.hidden is not None and not reads:
            return out, view
        rows = getattr(out, "logps", None)
        if rows is not None:  # a collective: every rank gathers, the group's first keeps them
            rows = self.whole_rows(rows)
            out = dataclasses.replace(out, logps=rows if self.group.rank == 0 else None)
        return out, self.whole_view(view)

    def whole_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row ``values`` of this rank's scored rows -> every rank's, in the whole batch's
        order, detached."""
        order = torch.cat(gather_rows(self._ordinals, self.group)).argsort()
        return torch.cat(gather_rows(values, self.group))[order]

    def whole_view(self, view: LossView) -> LossView:
        """``view`` (this rank's scored rows) with every rank's rows, detached, in the whole
        batch's order: what an evaluation's outputs read (``logps``) after the loss was computed,
        and a training step's where the loss read logits (``outputs.step_logps``)."""
        order = torch.cat(gather_rows(self._ordinals, self.group)).argsort()
        whole = {"targets": torch.cat(gather_rows(view.targets, self.group))[order]}
        for name in ("hidden", "logits"):
            value = getattr(view, name)
            if value is not None:
                whole[name] = torch.cat(gather_rows(value, self.group))[order]
        return dataclasses.replace(
            view, positions=self._gather, extras={}, samples=None, sequence=None, **whole
        )


def _padded(
    inputs: dict[str, Any], segments: Segments | None, pad: int
) -> tuple[dict[str, Any], Segments | None]:
    """The inputs with ``pad`` more positions: token 0 at positions 0.., never attended to by the
    real tokens (a sample of their own in a packed row; masked out of a padded batch)."""
    ids = inputs["input_ids"]
    rows = ids.shape[0]
    extra = torch.arange(pad, device=ids.device).expand(rows, pad)
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids, torch.zeros_like(extra)], dim=1)
    out["position_ids"] = torch.cat([inputs["position_ids"], extra.to(inputs["position_ids"].dtype)], dim=1)
    fill = torch.ones_like if segments is not None else torch.zeros_like
    out["attention_mask"] = torch.cat(
        [inputs["attention_mask"], fill(extra).to(inputs["attention_mask"].dtype)], dim=1
    )
    if segments is not None:
        end = segments.length
        spans = (*segments.spans, (end, end + pad))
        blocks = (*segments.blocks, (end, 0, 1)) if segments.blocks else ()
        segments = Segments(spans, segments.prefix, blocks)
        out["twinkle_segments"] = segments
    return out, segments


def check_model(config: Any, size: int) -> None:
    """One line for a model Ulysses cannot run at ``size``."""
    kind = getattr(config, "model_type", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if kind in HYBRID_MODEL_TYPES or "linear_attention" in layer_types:
        raise UserError(
            f"ulysses_size={size}: {kind} has linear-attention layers whose recurrent state runs from each "
            "position to the next across the whole sequence, which a rank holding a share of the positions "
            "cannot compute; use ulysses_size=1"
        )
    if kind not in PACKABLE_MODEL_TYPES:
        raise UserError(
            f"ulysses_size={size} runs the families {', '.join(PACKABLE_MODEL_TYPES)}; {kind} is not one "
            "of them; use ulysses_size=1"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise UserError(
            f"ulysses_size={size} does not divide the model's heads (num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads}); each rank attends with heads / ulysses_size of them"
        )


def check_folder(model_id: Any, config: Any, size: int) -> None:
    """``check_model`` before any weight loads: on ``config`` (the keyword the model was given) or
    a local folder's ``config.json`` (other ids are checked once loaded, ``install``)."""
    if size == 1:
        return
    if config is None:
        path = Path(str(model_id)) / "config.json" if model_id is not None else None
        if path is None or not path.is_file():
            return
        try:
            config = SimpleNamespace(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return  # the loader says what is wrong with the folder
        if not hasattr(config, "num_attention_heads"):
            return  # a composite config (text_config inside): checked once loaded
    check_model(config, size)


def install(lm: Any, mesh: DeviceMesh, rank: int) -> Ulysses | None:
    """Set up Ulysses on ``lm`` (a ``*ForCausalLM``, before adapters and sharding) under ``mesh``;
    None when ``ulysses_size`` is 1. Every rank calls it (it creates the process groups)."""
    if mesh.ulysses_size == 1:
        return None
    check_model(lm.config, mesh.ulysses_size)
    if not enable_ulysses_attention(lm.config):
        raise UserError(
            f"ulysses_size={mesh.ulysses_size} runs attention through Hugging Face's attention interface; "
            f"attn_implementation={lm.config._attn_implementation!r} is not in it; use 'sdpa'"
        )
    ulysses = Ulysses(sequence_group(mesh, rank))
    setattr(lm, ATTRIBUTE, ulysses)
    return ulysses


def ulysses_of(lm: Any) -> Ulysses | None:
    """The Ulysses set up on ``lm`` (a ``*ForCausalLM``), or None."""
    return getattr(lm, ATTRIBUTE, None)


def counted(ulysses: Ulysses | None, inputs: dict[str, Any]) -> tuple[int, int]:
    """``(rows, tokens)`` of a training batch that this rank counts (samples consumed, tokens
    seen): the whole batch, or under Ulysses on the group's first rank only, as every rank of a
    group holds the same rows."""
    if ulysses is not None and ulysses.group.rank:
        return 0, 0
    return inputs["input_ids"].shape[0], int(inputs["attention_mask"].sum())
