"""``TorchSampler``'s adapters: those a sampler with its own weights is given (``add_adapter``,
``load_adapter_weights``, from a trainer through ``receive_lora`` / ``receive_base_weights``, from
a PEFT folder by ``adapter_path=``), and which adapter a ``sample`` call runs (its own, the
trainer's when colocated, or none for ``use_base_model=True``).

A mixin of ``TorchSampler``: it reads the sampler's ``colocated``, ``source``, ``lm``, ``_own``,
``adapter_names``, ``default_adapter``, ``merged_keys`` and ``_by_path``."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from twinkle.model import MultiLoraTransformersModel
from twinkle.model.lora_modes import lora_layers
from twinkle.sampler import adapters
from twinkle.utils.errors import UserError
from twinkle.utils.modules import set_training


class SamplerAdapters:
    def add_adapter(self, adapter_name: str, config: Any) -> None:
        """Give a sampler's own copy an adapter ``adapter_name`` (a ``peft.LoraConfig``), zero
        until weights are written into it (``load_adapter_weights``)."""
        if self.colocated:
            raise UserError(
                "this sampler runs a TransformersModel's modules; add adapters to the model "
                "(model.add_adapter_to_model) and pick them with adapter_name="
            )
        if adapter_name in self.adapter_names:
            raise UserError(f"the sampler already has adapter {adapter_name!r}")
        adapters.install(self._own, adapter_name, config)
        self.adapter_names.append(adapter_name)

    def load_adapter_weights(self, adapter_name: str, tensors: dict[str, torch.Tensor]) -> int:
        """Copy an adapter's weights (saved names, ``TransformersModel.get_state_dict``) into
        adapter ``adapter_name`` of the sampler's own copy, in place; returns the bytes copied."""
        if adapter_name not in self.adapter_names:
            raise UserError(
                f"the sampler has no adapter {adapter_name!r}; adapters: {', '.join(self.adapter_names) or 'none'}"
            )
        return adapters.write(self._own, adapter_name, tensors)

    def receive_lora(self, adapter_name: str, config: Any, tensors: dict[str, torch.Tensor]) -> int:
        """A trainer's adapter weights (``CheckpointEngineManager``): added on first use, copied in
        place after; ``adapter_name=''`` runs it from now on. Returns the bytes copied."""
        if adapter_name not in self.adapter_names:
            self.add_adapter(adapter_name, config)
        written = self.load_adapter_weights(adapter_name, tensors)
        self.default_adapter = adapter_name
        return written

    @torch.no_grad()
    def receive_base_weights(self, weights: dict[str, torch.Tensor], merged: bool) -> int:
        """Copy full weights of linear layers (module key relative to the causal LM -> weight)
        into the sampler's own copy in place; returns the bytes copied. ``merged``: they hold a
        LoRA merged in, so ``adapter_name=''`` runs the base (now merged) without any adapter."""
        if self.colocated:
            raise UserError("this sampler runs a TransformersModel's modules; it has no weights of its own")
        written = 0
        for key, value in weights.items():
            module = self._own.get_submodule(key)
            target = module.base_layer.weight if hasattr(module, "base_layer") else module.weight
            target.copy_(value)
            written += target.numel() * target.element_size()
        if merged:
            self.merged_keys |= set(weights)
            self.default_adapter = None
        else:
            self.merged_keys -= set(weights)
        return written

    def _from_path(self, adapter_path: str | Path) -> str:
        """The adapter loaded from a PEFT folder (loaded on first use, then kept by path)."""
        if self.colocated:
            raise UserError(
                "adapter_path= needs a sampler with its own weights (TorchSampler(model_id)); a sampler "
                "sharing a TransformersModel samples the model's adapters: pass adapter_name="
            )
        key = str(Path(adapter_path).resolve())
        if key not in self._by_path:
            config, tensors = adapters.read_folder(adapter_path)
            name = f"path{len(self._by_path)}"
            self.add_adapter(name, config)
            self.load_adapter_weights(name, tensors)
            self._by_path[key] = name
        return self._by_path[key]

    @contextlib.contextmanager
    def _adapter(
        self, adapter_name: str | None, adapter_path: str | Path | None, base: bool = False
    ) -> Iterator[None]:
        """Run the adapter a ``sample`` call asks for (see ``sample``)."""
        if base:
            with self._base_model(adapter_name, adapter_path):
                yield
            return
        if adapter_path is not None:
            if adapter_name:
                raise UserError("sample: pass adapter_name= or adapter_path=, not both")
            adapter_name = self._from_path(adapter_path)
        if self.colocated:
            with self._trainer_adapter(adapter_name or None):
                yield
            return
        if adapter_name and adapter_name not in self.adapter_names:
            raise UserError(
                f"unknown adapter {adapter_name!r}; the sampler's adapters: {', '.join(self.adapter_names) or 'none'}"
            )
        layers = lora_layers(self._own)
        with adapters.running_adapter(layers, adapter_name or self.default_adapter):
            yield

    @contextlib.contextmanager
    def _base_model(self, adapter_name: str | None, adapter_path: str | Path | None) -> Iterator[None]:
        """``use_base_model=True``: no adapter runs."""
        if adapter_name or adapter_path is not None:
            raise UserError(
                "sample: use_base_model=True runs no adapter; drop adapter_name= and adapter_path="
            )
        if self.merged_keys:
            raise UserError(
                "sample: use_base_model=True, but the sampler's weights hold a merged adapter "
                "(sync_weights(merge_and_sync=True)); sync with merge_and_sync=False to keep the base apart"
            )
        if isinstance(self.source, MultiLoraTransformersModel):
            raise UserError("sample: not supported yet: use_base_model=True on a MultiLoraTransformersModel")
        if self.colocated and self.source.model.training:  # as _trainer_adapter: dropout off
            set_training(self.source.model, False)
            self.source._in_train_mode = False
        with adapters.running_adapter(
            lora_layers(self.lm if not self.colocated else self.source.model), None
        ):
            yield

    @contextlib.contextmanager
    def _trainer_adapter(self, adapter_name: str | None) -> Iterator[None]:
        """The trainer's adapter ``adapter_name`` (None: its only one) runs, in eval mode."""
        model = self.source
        if model.model.training:  # dropout off; the model's next forward() turns training mode back on
            set_training(model.model, False)
            model._in_train_mode = False
        if not model.optimizer_group:
            if adapter_name:
                model._group(adapter_name)  # the error naming the model's adapters
            yield  # a model without adapters: the base model
            return
        group = model._group(adapter_name)
        if isinstance(model, MultiLoraTransformersModel):
            model.adapters.activate(group.adapter_name)
            yield
            return
        layers = lora_layers(model.model)  # read per call: the model may gain adapters
        with adapters.running_adapter(layers, model.adapters.peft_name(group.adapter_name)):
            yield
