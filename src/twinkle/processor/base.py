"""``InputProcessor``: a rank's encoded rows -> the padded batch of tensors a model step runs."""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twinkle.processor.collate import collate
from twinkle.utils.errors import UserError

PADDING_SIDES = ("right", "left")
FRAMEWORKS = ("transformers",)


class InputProcessor:
    """Encoded rows (``input_ids``, ``labels`` lists; preference pairs ``{'positive',
    'negative'}`` as their two sides) -> ``input_ids``, ``labels``, ``attention_mask`` and
    ``position_ids`` tensors of shape ``(rows, longest)`` (``twinkle.processor.collate``).

    The model's step is where a batch is laid out for speed: a padding-free model
    (``TransformersModel(padding_free=True)``, the default) packs the padded batch into one row
    with attention per sample, so the processor's output stays the plain padded batch, which is
    also what a loss and ``forward_only``'s ``logps`` are shaped like.

    - ``device_mesh``: accepted for upstream's signature; every rank collates its own rows, so
      there is nothing to split by rank here.
    - ``padding_free``: asks the model to run the batch packed; ``set_processor`` refuses it on a
      model built with ``padding_free=False``.
    - ``framework``: ``'transformers'`` only.
    - ``padding_side``: ``'right'`` (training: what packing reads) or ``'left'`` (the tokens
      end together, as for generation; the model runs such a batch padded).
    - ``pad_token_id``: the id written in pad positions; None writes 0 (``set_processor`` on a
      model and ``DataLoader.set_processor`` pass the tokenizer's)."""

    def __init__(
        self,
        device_mesh: Any = None,
        padding_free: bool = False,
        framework: str = "transformers",
        padding_side: str = "right",
        pad_token_id: int | None = None,
    ):
        if framework not in FRAMEWORKS:
            raise UserError(
                f"InputProcessor(framework={framework!r}) is not supported yet: {framework}; use 'transformers'"
            )
        if padding_side not in PADDING_SIDES:
            raise UserError(
                f"InputProcessor(padding_side={padding_side!r}): use one of {', '.join(PADDING_SIDES)}"
            )
        self.device_mesh = device_mesh
        self.padding_free = bool(padding_free)
        self.framework = framework
        self.padding_side = padding_side
        self.pad_token_id = pad_token_id

    def __call__(self, inputs: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, torch.Tensor]:
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        return collate(rows, pad, self.padding_side)

    def __repr__(self) -> str:
        return (
            f"InputProcessor(padding_free={self.padding_free}, padding_side={self.padding_side!r}, "
            f"pad_token_id={self.pad_token_id})"
        )


PROCESSORS: dict[str, type] = {"InputProcessor": InputProcessor}


def processor_class(name: str, where: str) -> type:
    """The processor class called ``name``; an unknown name lists the valid ones."""
    if name not in PROCESSORS:
        raise UserError(f"{where}: unknown processor {name!r}; valid names: {', '.join(PROCESSORS)}")
    return PROCESSORS[name]
