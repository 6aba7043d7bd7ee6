"""``CheckpointEngineManager.sync_weights`` between device groups of the single controller.

When the trainer and the sampler live on groups of their own (``remote_group=``), the weights
travel through Ray's object store: the trainer's ranks compute what to send (every rank takes
part, as FSDP gathers the adapter's shards), rank 0's copy stays in its process, and each rank
of the sampler's group fetches it from there, never through the driver. What is sent is what
the local manager sends: the adapter's LoRA matrices by default, the merged base weights with
``merge_and_sync=True``, and the plain base weights first where the sampler still holds merged
ones."""

from typing import Any

from twinkle.checkpoint_engine.weights import base_weight, merged_weights
from twinkle.runtime.remote import RemoteObject


def is_remote(obj: Any) -> bool:
    return isinstance(obj, RemoteObject)


def sync_remote(
    model: RemoteObject, sampler: RemoteObject, adapter_name: str | None, merge: bool
) -> dict[str, Any]:
    """The trainer's weights into the sampler's copy; the local manager's summary dict."""
    stale = [] if merge else sorted(sampler.merged_keys)
    payload = model.run_on_ranks(_payload, adapter_name, merge, stale, keep=True).first()
    return sampler.run_on_ranks(_receive, payload)


def _payload(model: Any, adapter_name: str | None, merge: bool, stale: list[str]) -> dict[str, Any]:
    """In the trainer's worker: what the sampler needs (see the module docstring)."""
    group = model._group(adapter_name)
    tensors = model.get_state_dict(group.adapter_name)
    config = model.adapters.lora_config(group.adapter_name)
    if merge:
        return {"mode": "merged", "weights": merged_weights(model, tensors, config)}
    base = {key: base_weight(model, key).detach().clone() for key in stale}
    return {"mode": "lora", "name": group.adapter_name, "config": config, "tensors": tensors, "base": base}


def _receive(sampler: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """In the sampler's worker: the payload written into its copy; the summary."""
    if payload["mode"] == "merged":
        written = sampler.receive_base_weights(payload["weights"], merged=True)
        return {"mode": "merged", "tensors": len(payload["weights"]), "bytes": written}
    written = sampler.receive_base_weights(payload["base"], merged=False) if payload["base"] else 0
    written += sampler.receive_lora(payload["name"], payload["config"], payload["tensors"])
    return {"mode": "lora", "tensors": len(payload["tensors"]), "bytes": written}
