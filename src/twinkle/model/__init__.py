"""The model facade: ``TransformersModel`` (load, LoRA, optimizer, step, metrics, checkpoints).

Public names: ``TransformersModel``, ``OptimizerGroup``."""

from twinkle.model.train_state import OptimizerGroup
from twinkle.model.transformers_model import TransformersModel

__all__ = ["TransformersModel", "OptimizerGroup"]
