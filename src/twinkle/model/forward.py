"""The forward pass up to the loss: hidden states of supervised positions -> head + loss.

The model's own forward runs with its output head swapped for the identity, so the
``(batch, seq, vocab)`` logits tensor is never built; the loss applies the head only where the
next token is supervised (see ``twinkle.loss``). Running the top-level forward (rather than the
inner decoder) keeps FSDP2's root hooks in play, which gather the embedding and final norm.

A loss of upstream's convention (``consumes = "positions"``: ``loss(inputs, outputs)``, any
callable that is not a ``twinkle.loss.HeadLoss``) gets the real logits instead
(``positions_view``).

``task_loss`` is the loss a step runs for its ``task``, ``batch_on_device`` the batch it runs on."""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from twinkle.kernel.lora.linear import plain_linear
from twinkle.loss import FusedLinearCrossEntropyLoss, HeadLoss, LossOutput
from twinkle.loss.base import EMBEDDINGS, POSITIONS, Loss, LossView, as_loss
from twinkle.loss.cross_entropy import target_logps
from twinkle.model.packing import can_pack, pack, shifted_targets
from twinkle.model.router_aux import counts_every_token
from twinkle.model.router_replay import replay_of
from twinkle.model.ulysses import ulysses_of
from twinkle.model.vision import check_patches, check_reads_images
from twinkle.model.vision_inputs import gemma_image_inputs
from twinkle.model.vision_packing import can_pack_images, pack_images
from twinkle.model.vision_positions import token_type_inputs
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

TASKS = ("causal_lm", "fused_lm_ce", "embedding")  # embedding: twinkle.model.embedding
logger = get_logger()


def causal_lm_of(model: Any) -> Any:
    """The ``*ForCausalLM`` module under any PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_logit_transform(lm: Any) -> bool:
    """Models that post-process logits (soft-capping, scaling) need their real head in the forward.
    A vision-language model keeps these in its language model's config (Gemma 4's soft-capping)."""
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    return bool(getattr(cfg, "final_logit_softcapping", None)) or getattr(cfg, "logit_scale", None) not in (
        None,
        1.0,
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    # A copy, not a view: FSDP2 warns that in-place ops on a root output view would skip its
    # backward hook. The copy is one (batch, seq, hidden) tensor, small beside the layers.
    return x.clone()


@contextlib.contextmanager
def head_as_identity(head: torch.nn.Module) -> Iterator[None]:
    saved = head.__dict__.get("forward")
    head.forward = _identity
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """The whole head weight; under FSDP2 a sharded parameter is gathered (it is frozen for LoRA)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def _model_inputs(
    lm: Any, batch: dict[str, Any], padding_free: bool, share_prefix: bool | Sequence[str] = True
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """The forward's keyword arguments, each position's target (``IGNORE_INDEX`` where none) and
    the packed row's ``gather`` (``twinkle.model.packing``; None: the targeted positions in order)."""
    packed = None
    if padding_free and can_pack_images(lm, share_prefix):  # Qwen VL families (vision_packing)
        packed = pack_images(lm, batch)
    elif padding_free and can_pack(lm, share_prefix) and "pixel_values" not in batch:
        packed = pack(batch, share_prefix, keep_tails=counts_every_token(lm))  # router_aux's tokens
    replay = replay_of(lm)  # routing replay arms the forward in the layout it runs
    if packed is not None:
        where = packed.pop("where")
        if replay is not None:
            replay.arm(batch, where)
        return packed, packed.pop("targets"), packed.pop("gather")
    if replay is not None:
        replay.arm(batch, None)
    return _padded_inputs(lm, batch), shifted_targets(batch["labels"], batch["attention_mask"]), None


def _padded_inputs(lm: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The padded forward's inputs; with images, their patches and grids, which tokens are an
    image's, and no position_ids (the model derives its M-RoPE positions from them:
    ``twinkle.model.vision_positions``)."""
    if "pixel_values" not in batch:
        return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    gemma = gemma_image_inputs(lm, batch)  # Gemma 3 and 4: their images and token types
    if gemma is not None:
        return gemma
    check_patches(lm, batch["pixel_values"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
    return {**inputs, **token_type_inputs(lm, batch["input_ids"])}


def _extras(loss: Loss, batch: Mapping[str, Any]) -> None:
    missing = [k for k in loss.extra_inputs if not torch.is_tensor(batch.get(k))]
    # a rank's empty share of a short last batch is one unlabelled pad: nothing to weigh
    if missing and bool((batch["labels"] != IGNORE_INDEX).any()):
        raise UserError(
            f"the loss {loss.name} needs the batch tensor(s) {missing}; add them to every batch "
            "(per-token values aligned with labels)"
        )


def compute_loss(
    model: Any, batch: dict[str, torch.Tensor], loss_fn: Any, padding_free: bool = True
) -> LossOutput:
    """Summed token loss of ``batch`` (labels aligned with ``input_ids``, shifted here): the
    model computes what ``loss_fn.consumes`` asks for (``twinkle.loss.base``), once, and the
    loss computes the ``LossOutput`` from it. A plain callable is wrapped (``as_loss``).

    With ``padding_free`` the batch runs packed into one row (see ``twinkle.model.packing``);
    the loss is the same either way."""
    return loss_and_view(model, batch, loss_fn, padding_free)[0]


def loss_and_view(
    model: Any,
    batch: dict[str, torch.Tensor],
    loss_fn: Any,
    padding_free: bool = True,
    share_prefix: bool | Sequence[str] = True,
) -> tuple[LossOutput, LossView]:
    """``compute_loss`` and the view it computed the loss from (``twinkle.model.outputs`` reads
    the labels' log-probabilities from it). ``share_prefix``: as ``packing.pack`` takes it (the
    rows' adapter names, where they run through different adapters)."""
    lm = causal_lm_of(model)
    check_reads_images(lm, batch)
    loss = as_loss(loss_fn)
    _extras(loss, batch)
    ulysses = ulysses_of(lm)
    if ulysses is not None:  # each rank scores its share of the positions (twinkle.model.ulysses)
        ulysses.check_loss(loss)
    if loss.consumes == POSITIONS:
        view = positions_view(lm, batch, loss)
    else:
        view = rows_view(lm, batch, padding_free, loss.extra_inputs, share_prefix)
        if loss.require_samples:
            view.samples = supervised_samples(batch)
    if ulysses is None:
        out = loss.compute(view)
        return out, view
    view = ulysses.local_view(view)  # this rank's per-token inputs and samples, and the group
    return ulysses.whole(loss.compute(view), view, loss, lm.training)


def supervised_samples(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch row of each supervised position, in row-major order: the order of the rows
    view's rows, packed or not (a packed row lays the samples end to end and its shared prefix
    holds no target, ``twinkle.model.packing``)."""
    targets = shifted_targets(batch["labels"], batch["attention_mask"])
    return (targets != IGNORE_INDEX).nonzero(as_tuple=True)[0]


def _next_position(values: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` values aligned with the labels -> aligned with the targets (shifted by one)."""
    return torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)


def _rows_of(values: torch.Tensor | None, targets_2d: torch.Tensor) -> torch.Tensor:
    """An extra input at each position's target: a per-token ``(B, L)`` tensor aligned with the
    labels is shifted like them; a per-sample ``(B,)`` one holds for every token of its sample;
    an absent one (an empty rank's pad, see ``_extras``) is zero."""
    if values is None:
        return torch.zeros(targets_2d.shape, device=targets_2d.device)
    if values.dim() == 1:
        return values[:, None].expand(targets_2d.shape)
    return _next_position(values)


def rows_view(
    lm: Any,
    batch: dict[str, Any],
    padding_free: bool,
    extra_inputs: tuple[str, ...],
    share_prefix: bool | Sequence[str] = True,
) -> LossView:
    """The supervised rows: their hidden states and the head, or their logits where the head
    cannot run apart from the model; ``extra_inputs`` at the same rows. Those are read from the
    padded batch, packed or not: a packed row holds the supervised positions in the padded batch's
    row-major order (``supervised_samples``)."""
    inputs, targets_2d, gather = _model_inputs(lm, batch, padding_free, share_prefix)
    # the scored positions in the padded batch's row-major order (a scored shared prefix repeats)
    mask = targets_2d != IGNORE_INDEX if gather is None else (0, gather)
    ulysses = ulysses_of(lm)
    if ulysses is not None:  # this rank runs its share of the positions
        inputs, targets_2d, mask, gather = ulysses.share(inputs, targets_2d, mask, gather)
        replay = replay_of(lm)
        if replay is not None:  # and replays (or records) the routes of those positions
            replay.share(ulysses.group, ulysses.span)
    targets = targets_2d[mask]
    padded = shifted_targets(batch["labels"], batch["attention_mask"]) if extra_inputs else targets_2d
    extras = {k: _rows_of(batch.get(k), padded)[padded != IGNORE_INDEX] for k in extra_inputs}
    head = lm.get_output_embeddings()
    # a head that is not a plain Linear (a LoRA on lm_head, a wrapper) runs as the model's own
    if has_logit_transform(lm) or not plain_linear(head):
        logits = lm(**inputs, use_cache=False).logits[mask].float()
        return LossView(targets=targets, logits=logits, extras=extras, batch=batch)
    with head_as_identity(head):
        hidden = lm(**inputs, use_cache=False).logits[mask]
    bias = getattr(head, "bias", None)
    return LossView(
        targets=targets,
        hidden=hidden,
        weight=full_weight(head.weight),
        bias=None if bias is None else full_weight(bias),
        extras=extras,
        batch=batch,
        positions=gather,
    )


def positions_view(lm: Any, batch: dict[str, torch.Tensor], loss: Loss) -> LossView:
    """The padded batch (never packed, so the loss sees ``(batch, seq)`` shapes): every
    position's target, the fp32 logits, and the targets' log-probabilities if required."""
    if loss.require_entropy:
        raise UserError(
            f"{loss.name}.require_entropy is not supported yet: require_entropy; the model "
            "hands logps and logits, compute the entropy from outputs['logits'] (require_logits = True)"
        )
    targets = shifted_targets(batch["labels"], batch["attention_mask"])
    model_inputs = _padded_inputs(lm, batch)
    replay = replay_of(lm)
    if replay is not None:  # routing replay: this forward runs the padded batch
        replay.arm(batch, None)
    logits = lm(**model_inputs, use_cache=False).logits.float()
    logps = target_logps(logits, targets) if loss.require_logps else None
    return LossView(targets=targets, logits=logits, logps=logps, batch=batch)


def batch_on_device(
    inputs: dict[str, torch.Tensor], device: torch.device, tokenizer: Any
) -> dict[str, torch.Tensor]:
    """The batch's tensors on ``device``; an empty one is one pad token without a label."""
    batch = {k: v.to(device, non_blocking=True) for k, v in inputs.items() if torch.is_tensor(v)}
    if batch["input_ids"].shape[0] == 0:
        # This rank's share of a short last batch is empty, but under FSDP it must still join
        # every collective: run one pad token that carries no label.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        one = torch.ones((1, 1), dtype=torch.long, device=device)
        batch = {
            "input_ids": one * pad,
            "labels": one * IGNORE_INDEX,
            "attention_mask": one,
            "position_ids": one * 0,
        }
    return batch


def task_loss(group: Any, task: str) -> Any:
    """The loss ``group`` computes for ``task`` (``TASKS``): its own, or for ``fused_lm_ce`` the
    fused cross-entropy that replaces it (once; ``UserError`` when it cannot)."""
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    loss = group.loss_fn
    over_embeddings = getattr(loss, "consumes", None) == EMBEDDINGS
    if (task == "embedding") != over_embeddings:
        name = getattr(loss, "name", type(loss).__name__)
        raise UserError(
            f"{name} trains embeddings; run the step with task='embedding'"
            if over_embeddings
            else f"task='embedding' needs a loss over embeddings (InfonceLoss), but the loss is {name}; "
            "model.set_loss(InfonceLoss(...))"
        )
    if task == "fused_lm_ce" and not isinstance(loss, FusedLinearCrossEntropyLoss):
        # the fused loss computes plain cross-entropy on every supervised token, nothing else
        unfusable = not isinstance(loss, HeadLoss) or getattr(loss, "dft", False)
        unfusable = unfusable or bool(loss.extra_inputs) or loss.require_samples  # weights, pairs
        if unfusable or getattr(loss, "ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
            raise UserError(
                f"task='fused_lm_ce' replaces the loss by FusedLinearCrossEntropyLoss, which cannot compute "
                f"{getattr(loss, 'name', type(loss).__name__)} as it is set; use task='causal_lm'"
            )
        logger.info(
            "task='fused_lm_ce': %s(reduction=%r) replaced by FusedLinearCrossEntropyLoss (the same "
            "cross-entropy, one chunk of logits at a time)",
            type(loss).__name__,
            loss.reduction,
        )
        group.loss_fn = FusedLinearCrossEntropyLoss(reduction=loss.reduction)
    return group.loss_fn
