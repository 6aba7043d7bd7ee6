"""What the server checks of a client's input before it reaches the model or the file system, and
what it sends back of an error.

* ``load_json``: a request body parsed with a depth limit (``MAX_DEPTH`` levels of objects and
  lists, walked without recursion); every object comes back as ``Fields``, a dict that knows its
  dotted path in the body (``sampling_params``, ``prompt.chunks[0]``), so a bad field is named
  in full.
* ``check_int``, ``check_id``, ``check_name``: integers within int64 (or the field's own range in
  ``RANGES``), ids of bounded length and plain characters, checkpoint names that fit a file name
  once a save wraps them in its temporary ``.<name>.tmp`` (``MAX_NAME_CHARS`` characters and
  ``MAX_NAME_BYTES`` UTF-8 bytes, none of ``/``, ``\\``, a control character, a leading ``.``).
* ``checkpoint_parts``: ``tinker://<run>/<kind>/<name>`` split and checked.
* ``page``: the ``limit``/``offset`` of a listing.
* ``scrub`` and ``one_line``: an error message as a client may see it: one line, of bounded
  length, without the server's absolute paths (a checkpoint's file becomes its ``tinker://``
  path, any other file ``<server path>/<file name>``).

Every refusal is a ``BadRequest`` (400) whose message names the field and the limit."""

import contextlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle.server.errors import BadRequest, NotFound

MAX_DEPTH = 32  # objects and lists; the SDK's deepest request (a sample's prompt chunks) nests 5
MAX_NAME_CHARS = 128
MAX_NAME_BYTES = 200  # + the 5 of ``.<name>.tmp``: well under the 255-byte file-name limit
MAX_ID_CHARS = 128
MAX_PAGE = 1000
MAX_MESSAGE = 2000  # characters of an error message sent to a client
INT64_MAX = 2**63 - 1
INT64 = (-(2**63), INT64_MAX)
CHECKPOINT_KINDS = ("weights", "sampler_weights")
# integer fields with a range of their own (by dotted path); every other integer is an int64
RANGES = {
    "sampling_params.seed": (0, INT64_MAX),
    "lora_config.seed": (0, INT64_MAX),
    "model_seq_id": (0, INT64_MAX),
}
# string fields that are ids: looked up, never trusted as file names
IDS = frozenset({"model_id", "request_id", "session_id", "sampling_session_id"})


class Fields(dict):
    """A JSON object of a request body; ``where`` is its dotted path there ('' for the body)."""

    def __init__(self, data: Mapping, where: str = ""):
        super().__init__(data)
        self.where = where

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)``, at most about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _int_range(lo: int, hi: int) -> str:
    def one(n: int) -> str:
        return {INT64_MAX: "2**63-1", -(2**63): "-2**63"}.get(n, str(n))

    return f"{one(lo)}..{one(hi)}"


# ---------------------------------------------------------------- bodies
def load_json(raw: bytes) -> Fields:
    """The JSON object in ``raw``; ``BadRequest`` when it is not one, or nests deeper than
    ``MAX_DEPTH``. ``NaN``/``Infinity`` parse as NaN (``field`` refuses them by name)."""
    try:
        data = json.loads(raw or b"{}", parse_constant=lambda c: math.nan)
    except RecursionError:
        raise BadRequest(too_deep()) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({one_line(str(exc), 200)})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    return wrap(data)


def too_deep() -> str:
    return f"the request body nests objects and lists deeper than the limit of {MAX_DEPTH} levels"


def wrap(data: dict) -> Fields:
    """``data`` with every object in it a ``Fields`` (replaced in place in their lists and
    objects); ``BadRequest`` when it nests deeper than ``MAX_DEPTH``. Walked with a stack."""
    top = Fields(data)
    stack: list[tuple[Any, str, int]] = [(top, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(too_deep())
        is_list = isinstance(node, list)
        if is_list and not {dict, list} & set(map(type, node)):  # a list of scalars (token ids)
            continue
        for key, value in enumerate(node) if is_list else node.items():  # values replaced in place only
            if isinstance(value, dict | list):
                inner = f"{where}[{key}]" if is_list else (f"{where}.{key}" if where else str(key))
                if isinstance(value, dict):
                    value = node[key] = Fields(value, inner)
                stack.append((value, inner, depth + 1))
    return top


# ---------------------------------------------------------------- fields
def check_int(value: int, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` if ``lo <= value <= hi`` (by default the range ``RANGES`` gives ``what``, else
    int64's)."""
    dlo, dhi = RANGES.get(what, INT64)
    lo, hi = dlo if lo is None else lo, dhi if hi is None else hi
    if not lo <= value <= hi:
        raise BadRequest(f"{what} must be an integer in {_int_range(lo, hi)}, got {_number(value)}")
    return value


def check_float(value: int | float, what: str) -> float:
    """``value`` if it is a finite number (an integer too large for a float is not)."""
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise BadRequest(f"{what} must be a finite number, got {_number(value)}")
    return value


def _number(value: int | float) -> str:
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return str(value)


def check_id(value: str, what: str) -> str:
    """``value`` if it is an id: at most ``MAX_ID_CHARS`` printable characters, none of ``/``
    or ``\\``."""
    if len(value) > MAX_ID_CHARS:
        raise BadRequest(f"{what} must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    if not value.isprintable() or "/" in value or "\\" in value:
        raise BadRequest(
            f"{what} must be printable characters without '/' or '\\' (an id this server gave), "
            f"got {shown(value)}"
        )
    return value


def check_name(value: str, what: str) -> str:
    """``value`` if it is a plain checkpoint name: 1 to ``MAX_NAME_CHARS`` printable characters
    and at most ``MAX_NAME_BYTES`` bytes in UTF-8, none of ``/`` or ``\\``, not starting with
    ``.``."""
    rule = (
        f"a plain name of at most {MAX_NAME_CHARS} characters and {MAX_NAME_BYTES} UTF-8 bytes "
        "(no '/', '\\', control characters, or leading '.')"
    )
    if not value:
        raise BadRequest(f"{what} must be {rule}, got an empty name")
    if len(value) > MAX_NAME_CHARS:
        raise BadRequest(f"{what} must be {rule}, got {len(value)} characters")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise BadRequest(f"{what} must be {rule}, got {size} bytes")
    if not value.isprintable() or "/" in value or "\\" in value or value.startswith("."):
        raise BadRequest(f"{what} must be {rule}, got {shown(value)}")
    return value


def checkpoint_parts(path: str, kinds: Any = CHECKPOINT_KINDS, what: str = "checkpoint path") -> list[str]:
    """[run, kind, name] of ``tinker://<run>/<kind>/<name>``: ``NotFound`` when it is not such a
    path, ``BadRequest`` when its run id or name could not be one."""
    prefix = next((p for p in ("tinker://", "twinkle://") if path.startswith(p)), None)  # upstream's both
    parts = path[len(prefix) :].split("/") if prefix else []
    if len(parts) != 3 or parts[1] not in kinds or not parts[2] or not parts[0]:
        raise NotFound(
            f"{shown(path, 200)} is not a checkpoint path (tinker://<run>/weights|sampler_weights/<name>)"
        )
    check_id(parts[0], f"the run id of the {what}")
    check_name(parts[2], f"the checkpoint name of the {what}")
    return parts


def page(query: Mapping[str, str], default_limit: int) -> tuple[int, int]:
    """(limit, offset) of a listing's query: ``limit`` 1..``MAX_PAGE`` (``default_limit`` when
    absent), ``offset`` 0 or more."""

    def read(name: str, default: int, lo: int, hi: int) -> int:
        raw = query.get(name)
        if raw is None:
            return default
        if not re.fullmatch(r"-?[0-9]{1,19}", raw) or not lo <= int(raw) <= hi:
            raise BadRequest(
                f"query parameter {name!r} must be an integer in {_int_range(lo, hi)}, got {shown(raw)}"
            )
        return int(raw)

    return read("limit", default_limit, 1, MAX_PAGE), read("offset", 0, 0, INT64_MAX)


# ---------------------------------------------------------------- messages to clients
_BOUNDARY = r"(?<![^\s'\"(\[{=,])"  # a path starts a message, or follows a space, quote, bracket, = or ,
_ABSOLUTE = re.compile(_BOUNDARY + r"/[^\s'\"`<>|*?,;()\[\]{}]+")


def scrub(message: str, root: Path) -> str:
    """``message`` without the server's absolute paths: a path in a checkpoint under ``root``
    (``<root>/<tenant>/<run>/<kind>/<name>/...``) becomes ``tinker://<run>/<kind>/<name>/...``;
    any other absolute path ``<server path>/<its file name>``. URLs, ``tinker://`` paths and the
    API's routes (``/api/...``) stay."""
    root = Path(root)
    found = {os.path.abspath(root)}
    with contextlib.suppress(OSError, RuntimeError):
        found.add(str(root.resolve()))
    forms = sorted(found, key=len, reverse=True)
    if not root.is_absolute():  # paths the server wrote relative to its working folder
        message = re.sub(_BOUNDARY + re.escape(str(root)) + "/", lambda m: forms[0] + "/", message)
    kinds = "|".join(CHECKPOINT_KINDS)
    for form in forms:
        checkpoint = re.compile(re.escape(form.rstrip("/")) + rf"/[^/\s'\"]+/([^/\s'\"]+)/({kinds})/")
        message = checkpoint.sub(lambda m: f"tinker://{m.group(1)}/{m.group(2)}/", message)
    return _ABSOLUTE.sub(_placeholder, message)


def _placeholder(match: re.Match) -> str:
    path = match.group(0)
    tail = len(path) - len(path.rstrip(".:"))
    path, end = path[: len(path) - tail], path[len(path) - tail :]
    names = [p for p in path.split("/") if p]
    if path.startswith("/api/") or len(names) < 2:  # a route of this API, or no folder to hide
        return match.group(0)
    return f"<server path>/{names[-1]}{end}"


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message`` as one line of at most ``limit`` characters that encodes as UTF-8."""
    text = " ".join(str(message).split("\n")).replace("\r", " ")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def for_client(message: str, root: Path) -> str:
    """An error message as a client gets it: ``scrub`` then ``one_line``."""
    return one_line(scrub(message, root))


__all__ = [
    "IDS",
    "MAX_DEPTH",
    "MAX_ID_CHARS",
    "MAX_NAME_BYTES",
    "MAX_NAME_CHARS",
    "RANGES",
    "Fields",
    "check_float",
    "check_id",
    "check_int",
    "check_name",
    "checkpoint_parts",
    "for_client",
    "load_json",
    "one_line",
    "page",
    "scrub",
]
