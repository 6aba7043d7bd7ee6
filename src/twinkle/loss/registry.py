"""Loss names accepted by ``model.set_loss``, and how a checkpoint records the loss it was
trained with (``loss_record``: its class name and constructor arguments) so that ``build_loss``
rebuilds it (``twinkle eval``).

A loss keeps each constructor argument under its own name (``self.beta = beta``): that is what
``loss_settings`` reads back. A registered loss that does not is caught by its test."""

import inspect
import math
from typing import Any

from twinkle.loss.chunked_cross_entropy import ChunkedCrossEntropyLoss
from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.dpo import DPOLoss
from twinkle.loss.fused_linear_ce import FusedLinearCrossEntropyLoss
from twinkle.loss.gkd import GKDLoss
from twinkle.loss.grpo import BNPOLoss, CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss
from twinkle.loss.infonce import InfonceLoss
from twinkle.loss.liger_fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
from twinkle.loss.mse import MSELoss
from twinkle.loss.preference import CPOLoss, ORPOLoss, SimPOLoss
from twinkle.loss.sapo import SAPOLoss
from twinkle.utils.errors import UserError

LOSSES: dict[str, type] = {
    "CrossEntropyLoss": CrossEntropyLoss,
    "ChunkedCrossEntropyLoss": ChunkedCrossEntropyLoss,
    "FusedLinearCrossEntropyLoss": FusedLinearCrossEntropyLoss,
    # upstream's name; our chunked fused loss on every device (see its module)
    "LigerFusedLinearCrossEntropyLoss": LigerFusedLinearCrossEntropyLoss,
    "MSELoss": MSELoss,
    "DPOLoss": DPOLoss,  # the preference losses: interleaved pairs of rows (twinkle.loss.preference)
    "SimPOLoss": SimPOLoss,
    "CPOLoss": CPOLoss,
    "ORPOLoss": ORPOLoss,
    "GRPOLoss": GRPOLoss,  # policy losses over sampled completions (twinkle.loss.grpo)
    "GSPOLoss": GSPOLoss,
    "DRGRPOLoss": DRGRPOLoss,
    "CISPOLoss": CISPOLoss,
    "SAPOLoss": SAPOLoss,
    "BNPOLoss": BNPOLoss,
    "GKDLoss": GKDLoss,  # distillation from a teacher's token distributions (twinkle.loss.gkd)
    "InfonceLoss": InfonceLoss,  # contrastive loss over embeddings (task='embedding')
}

# upstream's names for the same classes (``twinkle.loss.torch_loss_mapping``)
torch_loss_mapping: dict[str, type] = {
    "mse": MSELoss,
    "chunked_cross_entropy": ChunkedCrossEntropyLoss,
    "cross_entropy": CrossEntropyLoss,
    "liger_fused_linear_cross_entropy": LigerFusedLinearCrossEntropyLoss,
    "gkd": GKDLoss,
    "grpo": GRPOLoss,
    "gspo": GSPOLoss,
    "sapo": SAPOLoss,
    "cispo": CISPOLoss,
    "bnpo": BNPOLoss,
    "dr_grpo": DRGRPOLoss,
    "dpo": DPOLoss,
    "simpo": SimPOLoss,
    "cpo": CPOLoss,
    "orpo": ORPOLoss,
    "infonce": InfonceLoss,
}


def build_loss(name: str, **kwargs: Any):
    if name not in LOSSES:
        raise UserError(f"unknown loss {name!r}; valid names: {', '.join(LOSSES)}")
    try:
        return LOSSES[name](**kwargs)
    except TypeError as exc:
        raise UserError(f"loss {name}: {exc}") from exc


def resolve_loss(loss_cls: Any, **kwargs: Any):
    """What ``model.set_loss`` takes: a name in ``LOSSES`` or a class (built with ``kwargs``), or
    a loss instance or callable (used as it is)."""
    if isinstance(loss_cls, str):
        return build_loss(loss_cls, **kwargs)
    if isinstance(loss_cls, type):
        try:
            return loss_cls(**kwargs)
        except TypeError as exc:
            raise UserError(f"loss {loss_cls.__name__}: {exc}") from exc
    if not callable(loss_cls):
        raise UserError(
            f"set_loss: {loss_cls!r} is neither a loss name ({', '.join(LOSSES)}), class nor callable"
        )
    if kwargs:
        raise UserError(f"set_loss got a loss instance and keywords {sorted(kwargs)}; pass one or the other")
    return loss_cls


def _plain(value: Any) -> bool:
    """A value JSON writes and reads back as it is."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, bool | int | str)


def loss_settings(loss: Any) -> dict[str, Any] | None:
    """The constructor arguments that rebuild ``loss`` (``type(loss)(**settings)``): each
    parameter of its class's ``__init__``, read from the attribute of the same name. None when
    one has no such attribute, holds something other than a plain JSON value (a callable, a
    tensor), or is gathered by ``*args``/``**kwargs``."""
    init = type(loss).__init__
    if init is object.__init__:
        return {}
    settings: dict[str, Any] = {}
    for name, param in list(inspect.signature(init).parameters.items())[1:]:  # after self
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or not hasattr(loss, name):
            return None
        value = getattr(loss, name)
        if not _plain(value):
            return None
        settings[name] = value
    return settings


def loss_record(loss: Any) -> dict[str, Any]:
    """What a checkpoint's ``trainer_state.json`` records of the loss it was trained with:
    ``loss``, its class name, and ``loss_args``, its constructor arguments (``loss_settings``)
    when they can be recorded."""
    settings = loss_settings(loss)
    return {"loss": type(loss).__name__, **({"loss_args": settings} if settings is not None else {})}
