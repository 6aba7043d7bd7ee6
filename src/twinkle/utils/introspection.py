"""Reading objects by path and functions by signature (upstream's ``deep_getattr``,
``signature_info``, ``has_signature_parameter``).

Upstream's ``call_with_supported_kwargs`` (call ``fn`` with only the keywords it declares) is not
provided: it drops a caller's keyword without a word, which Twinkle never does."""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

_MISSING = object()


def deep_getattr(obj: Any, attr: str, default: Any = None) -> Any:
    """``obj.a.b.c`` for ``attr='a.b.c'``, a mapping's keys read like attributes at any step;
    ``default`` as soon as a step is missing (or an object along the way is None)."""
    for name in attr.split("."):
        if obj is None:
            return default
        obj = obj.get(name, _MISSING) if isinstance(obj, Mapping) else getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return default
    return obj


def signature_info(fn: Callable[..., Any]) -> tuple[bool, frozenset[str]]:
    """(whether ``fn`` takes ``**kwargs``, the names of its parameters)."""
    params = inspect.signature(fn).parameters
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), frozenset(params)


def has_signature_parameter(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` declares a parameter ``name`` (``**kwargs`` does not count)."""
    return name in signature_info(fn)[1]
