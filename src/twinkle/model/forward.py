"""The forward pass up to the loss: hidden states of supervised positions -> head + loss.

The model's own forward runs with its output head swapped for the identity, so the
``(batch, seq, vocab)`` logits tensor is never built; the loss applies the head only where the
next token is supervised (see ``twinkle.loss``). Running the top-level forward (rather than the
inner decoder) keeps FSDP2's root hooks in play, which gather the embedding and final norm.

A loss of upstream's convention (``loss(inputs, outputs)``, any callable that is not a
``twinkle.loss.HeadLoss``) gets the real logits instead (``outputs_loss``)."""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from twinkle.kernel.lora.linear import plain_linear
from twinkle.loss import HeadLoss, LossOutput
from twinkle.loss.cross_entropy import target_logps, top_is_target
from twinkle.model.packing import can_pack, pack, shifted_targets
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError


def causal_lm_of(model: Any) -> Any:
    """The ``*ForCausalLM`` module under any PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_logit_transform(lm: Any) -> bool:
    """Models that post-process logits (soft-capping, scaling) need their real head in the forward."""
    cfg = lm.config
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


def _model_inputs(lm: Any, batch: dict[str, Any], padding_free: bool) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward's keyword arguments and each position's target (``IGNORE_INDEX`` where none)."""
    packed = pack(batch) if padding_free and can_pack(lm) else None
    if packed is not None:
        return packed, packed.pop("targets")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    return inputs, shifted_targets(batch["labels"], batch["attention_mask"])


def compute_loss(
    model: Any, batch: dict[str, torch.Tensor], loss_fn: Any, padding_free: bool = True
) -> LossOutput:
    """Summed token loss of ``batch`` (labels aligned with ``input_ids``, shifted here).

    With ``padding_free`` the batch runs packed into one row (see ``twinkle.model.packing``);
    the loss is the same either way."""
    lm = causal_lm_of(model)
    if not isinstance(loss_fn, HeadLoss):
        return outputs_loss(lm, batch, loss_fn)
    inputs, targets_2d = _model_inputs(lm, batch, padding_free)
    mask = targets_2d != IGNORE_INDEX
    targets = targets_2d[mask]
    head = lm.get_output_embeddings()
    # a head that is not a plain Linear (a LoRA on lm_head, a wrapper) runs as the model's own
    if has_logit_transform(lm) or not plain_linear(head):
        logits = lm(**inputs, use_cache=False).logits[mask].float()
        return loss_fn.logits_loss(logits, targets)
    with head_as_identity(head):
        hidden = lm(**inputs, use_cache=False).logits[mask]
    bias = getattr(head, "bias", None)
    return loss_fn.head_loss(
        hidden, full_weight(head.weight), targets, None if bias is None else full_weight(bias)
    )


def outputs_loss(lm: Any, batch: dict[str, torch.Tensor], loss_fn: Any) -> LossOutput:
    """``loss_fn(inputs, outputs)`` on the padded batch (never packed, so the loss sees
    ``(batch, seq)`` shapes): ``inputs`` is the batch with each position's target as ``labels``
    (-100 where none); ``outputs`` holds ``logps`` (unless ``loss_fn.require_logps`` is False)
    and ``logits`` (if ``loss_fn.require_logits``), in fp32. A result with a non-zero
    ``num_tokens`` is a sum over that many tokens; otherwise (a bare scalar, or ``num_tokens``
    0) it is a mean over the supervised tokens, and its sum is the mean times their count, so
    training still takes the mean over every supervised token of the global batch."""
    if getattr(loss_fn, "require_entropy", False):
        raise UserError(
            f"{type(loss_fn).__name__}.require_entropy is not supported yet: require_entropy; the model "
            "hands logps and logits, compute the entropy from outputs['logits'] (require_logits = True)"
        )
    targets = shifted_targets(batch["labels"], batch["attention_mask"])
    model_inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = lm(**model_inputs, use_cache=False).logits.float()
    mask = targets != IGNORE_INDEX
    outputs: dict[str, Any] = {"logits": logits if getattr(loss_fn, "require_logits", False) else None}
    if getattr(loss_fn, "require_logps", True):
        outputs["logps"] = target_logps(logits, targets)
    result = loss_fn({**batch, "labels": targets}, outputs)
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not (torch.is_tensor(loss) and loss.numel() == 1):
        raise UserError(
            f"the loss {getattr(loss_fn, '__name__', type(loss_fn).__name__)} returned {type(result).__name__}; "
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
