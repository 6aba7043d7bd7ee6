"""Clients of model services that answer a trajectory with assistant messages.

Public names: ``API`` (the interface: ``api(trajectory, sampling_params) -> Message | list``),
``OpenAI`` (``twinkle_agentic.protocol.openai``: any OpenAI-compatible ``/chat/completions``
endpoint)."""

from twinkle_agentic.protocol.base import API
from twinkle_agentic.protocol.openai import OpenAI

__all__ = ["API", "OpenAI"]
