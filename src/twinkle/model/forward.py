"""The forward pass up to the loss: body -> hidden states of supervised positions -> head + loss.

The head is applied only where the next token is supervised (see ``twinkle.loss``), so the
``(batch, seq, vocab)`` logits tensor is never built."""

from typing import Any

import torch

from twinkle.loss import LossOutput
from twinkle.template.base import IGNORE_INDEX


def causal_lm_of(model: Any) -> Any:
    """The ``*ForCausalLM`` module under any PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_logit_transform(lm: Any) -> bool:
    """Models that post-process logits (soft-capping, scaling) need their own full forward."""
    cfg = lm.config
    return bool(getattr(cfg, "final_logit_softcapping", None)) or getattr(cfg, "logit_scale", None) not in (None, 1.0)


def hidden_states(lm: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    body = getattr(lm, lm.base_model_prefix)
    out = body(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    return out.last_hidden_state


def compute_loss(model: Any, batch: dict[str, torch.Tensor], loss_fn: Any) -> LossOutput:
    """Summed token loss of ``batch`` (labels aligned with ``input_ids``, shifted here)."""
    lm = causal_lm_of(model)
    targets_2d = batch["labels"][:, 1:]
    mask = targets_2d != IGNORE_INDEX
    targets = targets_2d[mask]
    head = lm.get_output_embeddings()
    if has_logit_transform(lm):
        logits = lm(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
        selected = logits[:, :-1][mask].float()
        eye = torch.eye(selected.shape[-1], dtype=selected.dtype, device=selected.device)
        return loss_fn(selected, eye, targets)
    hidden = hidden_states(lm, batch)[:, :-1][mask]
    return loss_fn(hidden, head.weight, targets, getattr(head, "bias", None))
