"""``CheckpointEngineManager``: the trainer's weights -> the sampler's, after each training step.

- Colocated (``TorchSampler(model)``): the sampler runs the trainer's own modules, so a step is
  visible to the next ``sample`` as it is; ``sync_weights`` copies nothing, whatever
  ``merge_and_sync`` says (merged or not, the sampler computes the same function).
- A sampler with its own copy (``TorchSampler(model_id)``, ``vLLMSampler``):
  ``sync_weights()`` sends the adapter's LoRA matrices only (``TransformersModel.get_state_dict``):
  the first sync adds the adapter to the sampler, later ones copy into it in place, and
  ``sample(adapter_name='')`` runs it. ``sync_weights(merge_and_sync=True)`` sends, for each
  linear layer the adapter targets, the trainer's base weight plus the adapter's product
  (``W + scaling * B @ A``) into the sampler's base weights, which then run without an adapter.
  The base weights are never sent otherwise (they are frozen and both sides loaded them); a LoRA
  sync after a merged one first puts the plain base weights back."""

from typing import Any

from twinkle.checkpoint_engine.remote import is_remote, sync_remote
from twinkle.checkpoint_engine.weights import base_weight, merged_weights
from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError

PLATFORMS = ("GPU", "NPU", "CPU")


class CheckpointEngineManager:
    """``CheckpointEngineManager(model, sampler)``; ``adapter_name``: the trainer's adapter to
    send (None: its only one). ``platform``: upstream's device family (``GPU``, ``NPU``,
    ``CPU``), which picks its collective backend there; the weights here travel by an in-process
    copy or through Ray's object store, which work on each of them, so any of the three syncs
    the same way."""

    def __init__(self, model: Any, sampler: Any, platform: str = "GPU", adapter_name: str | None = None):
        if platform not in PLATFORMS:
            raise UserError(
                f"CheckpointEngineManager(platform={platform!r}): use one of {', '.join(PLATFORMS)}"
            )
        self.remote = is_remote(model) and is_remote(sampler)
        if not isinstance(model, TransformersModel) and not self.remote:
            raise UserError(
                f"CheckpointEngineManager(model=...) takes a TransformersModel, got {type(model).__name__}"
            )
        source = getattr(sampler, "source", None)
        if source is not None and source is not model:
            raise UserError(
                "the sampler runs the modules of another TransformersModel; build it with "
                "TorchSampler(model) of this model, or TorchSampler(model_id) for a copy of its own"
            )
        self.model, self.sampler, self.adapter_name = model, sampler, adapter_name
        self.last: dict[str, Any] = {}

    @property
    def colocated(self) -> bool:
        return getattr(self.sampler, "source", None) is self.model

    def sync_weights(self, merge_and_sync: bool = False, adapter_name: str | None = None) -> dict[str, Any]:
        """Bring the sampler up to the trainer's current weights (see the module docstring).
        Returns ``{'mode': 'colocated' | 'lora' | 'merged', 'tensors': n, 'bytes': b}``: what was
        copied (nothing when colocated)."""
        if self.remote:  # trainer and sampler on device groups of their own
            self.last = sync_remote(
                self.model, self.sampler, adapter_name or self.adapter_name, merge_and_sync
            )
            return self.last
        if self.colocated:
            self.last = {"mode": "colocated", "tensors": 0, "bytes": 0}
            return self.last
        name = self.model._group(adapter_name or self.adapter_name).adapter_name
        tensors = self.model.get_state_dict(name)
        config = self.model.adapters.lora_config(name)
        if merge_and_sync:
            weights = merged_weights(self.model, tensors, config)
            written = self.sampler.receive_base_weights(weights, merged=True)
            self.last = {"mode": "merged", "tensors": len(weights), "bytes": written}
            return self.last
        written = 0
        stale = sorted(getattr(self.sampler, "merged_keys", ()))
        if stale:  # the sampler's base holds merged weights: the plain ones first
            base = {key: base_weight(self.model, key).detach().clone() for key in stale}
            written += self.sampler.receive_base_weights(base, merged=False)
        written += self.sampler.receive_lora(name, config, tensors)
        self.last = {"mode": "lora", "tensors": len(tensors), "bytes": written}
        return self.last
