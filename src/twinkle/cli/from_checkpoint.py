"""What ``twinkle eval`` rebuilds from a checkpoint folder: the loss it was trained with
(``trained_loss``) and the model with its adapter (``checkpoint_model``).

A checkpoint's ``trainer_state.json`` records the loss's class (``loss``) and its constructor
arguments (``loss_args``, ``twinkle.loss.registry.loss_record``); any loss registered in
``twinkle.loss.LOSSES`` is rebuilt from them. A checkpoint that records no arguments rebuilds
``DPOLoss`` with the run's ``--beta``, ``--loss-type``, ``--sft-weight`` and
``--label-smoothing`` (its ``run_args.json``) and any other loss with its defaults; one that
records no loss is evaluated with the model's default loss."""

import json
from pathlib import Path
from typing import Any

from twinkle.checkpoint.layout import TRAINER_STATE, parse_trainer_state
from twinkle.utils.errors import UserError

# DPOLoss's settings as a run's run_args.json holds them (``loss`` group): what rebuilds a DPO
# checkpoint that records no ``loss_args``
RUN_LOSS_SETTINGS = ("beta", "loss_type", "sft_weight", "label_smoothing")


def trained_loss(folder: Path, run_settings: dict[str, Any]) -> Any:
    """The loss ``folder``'s trainer state records, built with its recorded arguments (see the
    module docstring; ``run_settings``: the run's settings, ``evaluate.training_settings``).
    None when the folder records no loss. A class that is not registered, or arguments that are
    not an object or that the class refuses, is a one-line ``UserError`` naming the file."""
    path = folder / TRAINER_STATE
    state = parse_trainer_state(folder) if path.is_file() else {}
    name = state.get("loss")
    if name is None:
        return None
    from twinkle.loss import LOSSES, build_loss

    if name not in LOSSES:
        raise UserError(
            f"{path} records the loss {name!r}, which twinkle eval cannot rebuild; it rebuilds the "
            f"registered losses: {', '.join(LOSSES)}"
        )
    args = state.get("loss_args")
    if args is None:  # none recorded: DPOLoss takes the run's settings, any other loss its defaults
        from_run = RUN_LOSS_SETTINGS if name == "DPOLoss" else ()
        return build_loss(name, **{k: run_settings[k] for k in from_run if k in run_settings})
    if not isinstance(args, dict):
        raise UserError(
            f"{path}: 'loss_args' is {json.dumps(args)[:40]}, not an object; restore the file or remove the field"
        )
    try:
        return build_loss(name, **args)
    except UserError as exc:
        raise UserError(f"{path}: its 'loss_args' do not build {name} ({exc}); restore the file") from None


def checkpoint_model(folder: Path, model_id: str | None) -> Any:
    """A ``TransformersModel`` of ``model_id`` with ``folder``'s adapter loaded as ``default``."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=model_id)
    model.add_adapter_to_model("default", LoraConfig.from_pretrained(str(folder)))
    model.load(str(folder), adapter_name="default")
    return model
