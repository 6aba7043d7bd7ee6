"""The model facade: ``TransformersModel`` (load, LoRA, optimizer, step, metrics, checkpoints).

Public names: ``TransformersModel``, ``MultiLoraTransformersModel`` (several adapters on one
base, ``twinkle.model.multi_lora``), ``OptimizerGroup``, ``InputProcessor`` (what turns encoded
rows into a batch, ``TransformersModel.set_processor``), ``MegatronModel`` and
``MultiLoraMegatronModel`` (upstream's names, run on the Transformers models:
``twinkle.model.megatron``)."""

from twinkle.model.inputs import InputProcessor
from twinkle.model.megatron import MegatronModel, MultiLoraMegatronModel
from twinkle.model.multi_lora import MultiLoraTransformersModel
from twinkle.model.train_state import OptimizerGroup
from twinkle.model.transformers_model import TransformersModel

__all__ = [
    "TransformersModel",
    "MultiLoraTransformersModel",
    "MegatronModel",
    "MultiLoraMegatronModel",
    "OptimizerGroup",
    "InputProcessor",
]
