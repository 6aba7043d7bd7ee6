"""What ``init_tinker_client`` changes in the Tinker SDK so that its unchanged ``ServiceClient``
talks to a ``twinkle server`` as upstream Twinkle's scripts expect:

- any API key is sent as it is: the SDK refuses a key without its ``tml-`` prefix before a
  request leaves, while a ``twinkle server`` started without keys takes any token (upstream's
  default ``EMPTY_TOKEN`` included), and one started with keys answers 401 to a wrong one;
- a ``twinkle://`` path is taken wherever the SDK takes a ``tinker://`` one (a sampler's
  ``model_path``, and every ``RestClient`` call that parses a path: publish, unpublish, delete,
  TTL, a run's lookup): it is the same checkpoint, so it is sent as its ``tinker://`` form;
- ``create_lora_training_client`` defaults to ``train_unembed=False``: LoRA on a
  ``twinkle server`` (as on upstream's) is on the linear layers of the blocks, never on the
  unembedding, and the server refuses ``train_unembed=True`` by name (the SDK's own default)
  rather than train something else than asked; a script that passes it explicitly still gets
  that refusal.

All are changes to the SDK's classes, made once; calling it again changes nothing."""

import functools
import inspect
import math
from typing import Any

_DONE = False
TWINKLE, TINKER = "twinkle://", "tinker://"


def as_tinker_path(path: str | None) -> str | None:
    """``twinkle://x`` as ``tinker://x``; any other value unchanged."""
    if isinstance(path, str) and path.startswith(TWINKLE):
        return TINKER + path[len(TWINKLE) :]
    return path


def patch_tinker() -> None:
    global _DONE
    if _DONE:
        return
    from tinker.lib import _auth_token_provider, internal_client_holder

    provider = _auth_token_provider.ApiKeyAuthProvider

    def any_key(self: Any, api_key: str) -> None:
        self._token = api_key
        self._expires_at = (
            math.inf if not api_key.startswith("eyJ") else _auth_token_provider._credential_expiry(api_key)
        )

    provider.__init__ = any_key
    holder = internal_client_holder.InternalClientHolder
    original = holder._create_sampling_session

    @functools.wraps(original)
    async def sampling_session(
        self: Any, model_path: str | None = None, base_model: str | None = None
    ) -> str:
        return await original(self, as_tinker_path(model_path), base_model)

    holder._create_sampling_session = sampling_session
    from tinker import types

    parse = types.ParsedCheckpointTinkerPath.from_tinker_path.__func__

    def from_path(cls: Any, tinker_path: str) -> Any:
        return parse(cls, as_tinker_path(tinker_path))

    types.ParsedCheckpointTinkerPath.from_tinker_path = classmethod(from_path)
    from tinker import ServiceClient

    for name in ("create_lora_training_client", "create_lora_training_client_async"):
        setattr(ServiceClient, name, _blocks_only(getattr(ServiceClient, name)))
    _DONE = True


def _blocks_only(create: Any) -> Any:
    """``create`` (a ``ServiceClient`` method) with ``train_unembed`` defaulting to False."""
    signature = inspect.signature(create)

    @functools.wraps(create)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments.setdefault("train_unembed", False)
        return create(*bound.args, **bound.kwargs)

    return wrapper
