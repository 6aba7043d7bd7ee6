"""Upstream's Megatron model names, run on the Transformers models where the sizes allow.

Public names: ``MegatronModel``, ``MultiLoraMegatronModel`` (``twinkle.model.megatron.fallback``)."""

from twinkle.model.megatron.fallback import MegatronModel, MultiLoraMegatronModel

__all__ = ["MegatronModel", "MultiLoraMegatronModel"]
