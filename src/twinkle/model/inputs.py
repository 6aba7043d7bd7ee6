"""What the model's steps accept: a ``DataLoader`` batch (a list of rows), raw chat rows, or a
batch of tensors.

``forward``, ``forward_backward`` and ``forward_only`` take a batch of tensors as it is. Given
rows (a dict or a list of dicts, as the ``DataLoader`` yields them), the model encodes each row
that has ``messages`` with its template (``set_template``; by default ``Template`` on the
model's tokenizer), keeps rows that already have ``input_ids`` and preference pairs
(``{'positive', 'negative'}``), and turns the encoded rows into a batch with its processor
(``set_processor``; by default ``twinkle.processor.InputProcessor``, right padding). An empty
list is a rank's empty share of a short last batch. Upstream keeps a template and a processor
per adapter for the same purpose."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from twinkle.model.router_replay import batch_routes
from twinkle.processor import InputProcessor
from twinkle.processor.base import processor_class
from twinkle.processor.collate import is_pair
from twinkle.template import Template, get_template
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad if pad is not None else 0


class InputsAPI:
    """Mixed into ``TransformersModel`` (which provides ``tokenizer``, ``runtime``, ``_group``,
    ``padding_free``, ``template_defaults``); ``prepare_inputs`` is what the steps call."""

    def set_template(
        self,
        template_cls: Any = "Template",
        adapter_name: str | None = None,
        model_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        """The template that encodes raw rows for ``adapter_name``: a name (``twinkle.template.
        TEMPLATES``), a ``Template`` subclass or instance. ``kwargs`` reach its constructor
        (``max_length``, ``truncation_strategy``, ``enable_thinking``, ...); its tokenizer is
        the model's, or ``model_id``'s when given. A template built here takes the model's
        ``template_defaults`` for the keywords not given (``MultiLoraTransformersModel``:
        ``max_length``)."""
        group = self._group(adapter_name)
        if isinstance(template_cls, Template):
            if kwargs or model_id is not None:
                given = sorted([*kwargs, *(["model_id"] if model_id is not None else [])])
                raise UserError(
                    f"set_template got a Template instance and keywords {given}; pass one or the other"
                )
            group.template = template_cls
            return
        kwargs = {**self.template_defaults, **kwargs}
        tokenizer = self.tokenizer if model_id is None else load_tokenizer(model_id)
        try:
            group.template = get_template(template_cls, tokenizer, **kwargs)
        except TypeError as exc:
            raise UserError(f"set_template({template_cls!r}): {exc}") from exc

    def set_processor(
        self, processor_cls: Any = "InputProcessor", adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """What turns encoded rows into a batch for ``adapter_name``: ``InputProcessor`` (by name
        or class, built with ``kwargs`` and the model's mesh), another class (built the same way),
        or any callable ``rows -> {input_ids, labels, attention_mask, position_ids}`` (tensors)."""
        group = self._group(adapter_name)
        if isinstance(processor_cls, str):
            processor_cls = processor_class(processor_cls, "set_processor")
        if isinstance(processor_cls, type):
            kwargs.setdefault("device_mesh", self.runtime.mesh)
            if issubclass(processor_cls, InputProcessor):
                kwargs.setdefault("pad_token_id", _pad_token_id(self.tokenizer))
            try:
                processor = processor_cls(**kwargs)
            except TypeError as exc:
                raise UserError(f"set_processor({processor_cls.__name__}): {exc}") from exc
        elif callable(processor_cls):
            if kwargs:
                raise UserError(
                    f"set_processor got a processor instance and keywords {sorted(kwargs)}; pass one or the other"
                )
            processor = processor_cls
        else:
            raise UserError(
                f"set_processor: {processor_cls!r} is neither a processor name, class nor callable"
            )
        if getattr(processor, "padding_free", False) and not self.padding_free:
            raise UserError(
                "the processor asks for padding_free=True, but this model runs padded batches; "
                "build it with TransformersModel(padding_free=True)"
            )
        group.processor = processor


def prepare_inputs(group: Any, inputs: Any, tokenizer: Any) -> Mapping[str, Any]:
    """A batch of tensors as it is; rows encoded (``group``'s template) and batched (its
    processor), the defaults built on ``tokenizer`` at first use."""
    if isinstance(inputs, Mapping) and torch.is_tensor(inputs.get("input_ids")):
        return inputs
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise UserError(
            f"inputs= got {type(inputs).__name__}; pass a batch from the DataLoader, or rows "
            "({'messages': [...]} or encoded {'input_ids': [...], 'labels': [...]})"
        )
    samples = []
    for i, row in enumerate(rows):
        if isinstance(row, Mapping) and ("input_ids" in row or is_pair(row)):
            samples.append(row)
        elif isinstance(row, Mapping) and "messages" in row:
            encoded = _template(group, tokenizer).encode(row["messages"], index=i)
            if encoded is not None and "routed_experts" in row:  # twinkle.model.router_replay
                encoded = {**encoded, "routed_experts": row["routed_experts"]}
            if encoded is not None:  # truncation_strategy='delete' drops a row that is too long
                samples.append(encoded)
        else:
            keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise UserError(
                f"input row {i} has neither 'messages' nor 'input_ids' ({keys}); pass chat or encoded rows"
            )
    batch = _batch(group, samples, tokenizer)
    if "routed_experts" not in batch:  # the rows' recorded experts (twinkle.model.router_replay)
        routes = batch_routes(samples, batch)
        if routes is not None:
            batch = {**batch, "routed_experts": routes}
    return batch


def _template(group: Any, tokenizer: Any) -> Any:
    if group.template is None:
        group.template = get_template("Template", tokenizer)
    return group.template


def _batch(group: Any, samples: list[Mapping[str, Any]], tokenizer: Any) -> Mapping[str, Any]:
    if group.processor is None:
        group.processor = InputProcessor(pad_token_id=_pad_token_id(tokenizer))
    processor: Callable[[list], Any] = group.processor
    batch = processor(samples)
    missing = [k for k in BATCH_KEYS if not (isinstance(batch, Mapping) and torch.is_tensor(batch.get(k)))]
    if missing:
        raise UserError(
            f"the processor {type(processor).__name__} returned no tensor for {missing}; "
            f"it must return a dict of tensors with {', '.join(BATCH_KEYS)}"
        )
    return batch
