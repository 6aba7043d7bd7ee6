"""Images of a conversation, for a vision-language template: each ``Message.images`` entry read
into a PIL image, and the images paired with the ``<image>`` tags of the user turns.

A conversation's images are taken in turn order and fill the ``<image>`` tags of its user turns
in order (upstream Twinkle's placement); a turn may also give its content as upstream's parts
(``{'type': 'text', 'text': ...}`` and ``{'type': 'image', 'url': ...}``), each image part a
tag with its picture; images beyond the tags go before the text of the first
user turn. A tag without an image, an image that cannot be read, one over PIL's size limit for a
file (``PIL.Image.MAX_IMAGE_PIXELS``, which guards against a small file that decodes to gigabytes)
and a URL (nothing is downloaded) are errors naming the row (``BadImage``)."""

import base64
import binascii
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.values import kind_of

IMAGE_TAG = "<image>"
_PART_KEYS = ("image", "url", "path")
_URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://", "oss://", "ms://", "hf://")


class BadImage(UserError):
    """Row ``index`` cannot be encoded because of an image (``field``, e.g.
    ``messages[0].images[1]``). The message is ``row <index><text>``; ``twinkle.dataset`` turns
    it into a bad row (its file and line, or counted and skipped with ``skip_bad_rows``)."""

    def __init__(self, index: int | None, field: str, text: str):
        self.index, self.field, self.text = index, field, text
        where = f"row {index}" if index is not None else "a row"
        super().__init__(f"{where}{text}")

    def __reduce__(self) -> tuple:  # worker processes send it back to the parent
        return (type(self), (self.index, self.field, self.text))


def _open(data: bytes | str | Path, index: int | None, field: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    what = f"{len(data)} bytes" if isinstance(data, bytes) else repr(str(data))
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image.load()  # decode now: a truncated file fails here, not inside the processor
    except FileNotFoundError:
        raise BadImage(index, field, f": {field}: no such image file {str(data)!r}") from None
    except Image.DecompressionBombError as exc:  # refused from the header, before decoding
        raise BadImage(
            index,
            field,
            f": {field} ({what}) is too large to decode: {str(exc).rstrip('.')}; downscale it, or raise "
            "PIL.Image.MAX_IMAGE_PIXELS for files you trust",
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise BadImage(index, field, f": {field} ({what}) cannot be decoded as an image: {exc}") from None
    return image.convert("RGB")


def _base64_image(uri: str, index: int | None, field: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URI: how a JSON-lines file holds a picture inline."""
    try:
        return base64.b64decode(uri.split(",", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise BadImage(index, field, f": {field} is a data URI whose base64 data does not decode") from None


def load_image(value: Any, index: int | None = None, field: str = "image") -> Any:
    """An RGB PIL image from a file path, the file's bytes, a PIL image, a ``{'bytes': ...,
    'path': ...}`` record or a base64 ``data:image/...`` URI; ``index`` and ``field`` name the
    row and the value in an error."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if isinstance(value, bytes):
        return _open(value, index, field)
    if isinstance(value, str) and value.startswith("data:image/") and ";base64," in value[:40]:
        return _open(_base64_image(value, index, field), index, field)
    if isinstance(value, str) and value.lower().startswith(_URL_SCHEMES + ("data:",)):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise BadImage(
            index,
            field,
            f": {field} is a URL ({shown}); images are read from local files, bytes or PIL images "
            "and nothing is downloaded: save the image and give its path",
        )
    if isinstance(value, str | Path):
        return _open(Path(value), index, field)
    raise BadImage(
        index, field, f": {field} is {kind_of(value)}; give a file path, the file's bytes or a PIL image"
    )


def _images_given(messages: list[dict[str, Any]], index: int | None) -> list[tuple[str, Any]]:
    """``(field, value)`` of every image of the conversation, in turn order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list | tuple):  # upstream's content parts: their images come first
            found += [(f"messages[{i}].content[{j}]", _part_image(p)) for j, p in _image_parts(content)]
        images = message.get("images") if isinstance(message, Mapping) else None
        if images is None:
            continue
        if isinstance(images, str | bytes) or not isinstance(images, list | tuple):
            raise BadImage(
                index, f"messages[{i}].images", f": messages[{i}].images is {kind_of(images)}, not a list"
            )
        found += [(f"messages[{i}].images[{j}]", value) for j, value in enumerate(images)]
    return found


def _image_parts(content: Any) -> list[tuple[int, Mapping[str, Any]]]:
    return [(j, p) for j, p in enumerate(content) if isinstance(p, Mapping) and p.get("type") == "image"]


def _part_image(part: Mapping[str, Any]) -> Any:
    """The picture of an image part: under ``image``, ``url`` (upstream's OlympiadBench rows) or
    ``path``; None when it has none (``load_image`` names the field)."""
    return next((part[k] for k in _PART_KEYS if part.get(k) is not None), None)


def _text_of(message: Mapping[str, Any], i: int, index: int | None) -> str:
    """A turn's text; content parts (``[{'type': 'text', 'text': ...}, {'type': 'image', ...}]``,
    upstream's multimodal content) joined, an ``<image>`` tag where each image part was."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return content
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "image":
            pieces.append(IMAGE_TAG)
        else:
            raise BadImage(
                index,
                f"messages[{i}].content[{j}]",
                f": messages[{i}].content[{j}] "
                + (f"has type {kind!r}" if isinstance(part, Mapping) else f"is {kind_of(part)}")
                + "; content parts are "
                "{'type': 'text', 'text': ...} or {'type': 'image', 'image' | 'url' | 'path': ...}",
            )
    return "".join(pieces)


def tagged_messages(messages: list[dict[str, Any]], index: int | None = None) -> list[dict[str, Any]]:
    """The conversation with each turn given as content parts rewritten as text with an
    ``<image>`` tag at each image part and those images first in its ``images``: what
    ``place_images`` reads either way, in a shape that a table of rows (Arrow) can hold beside
    turns whose content is text. Other turns are returned as they are."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list | tuple):
            out.append(message)
            continue
        own = message.get("images")
        if own is not None and (isinstance(own, str | bytes) or not isinstance(own, list | tuple)):
            raise BadImage(
                index, f"messages[{i}].images", f": messages[{i}].images is {kind_of(own)}, not a list"
            )
        parts = [_part_image(p) for _, p in _image_parts(content)]
        out.append({**message, "content": _text_of(message, i, index), "images": parts + list(own or [])})
    return out


def image_fields(messages: list[dict[str, Any]], index: int | None = None) -> list[str]:
    """The field of each image of the conversation (``messages[i].images[j]``), in the order
    ``place_images`` returns the images."""
    return [field for field, _ in _images_given(messages, index)]


def place_images(
    messages: list[dict[str, Any]], index: int | None = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(turns, images)``: the turns with ``content`` as a list of ``{'type': 'text', 'text':
    ...}`` and ``{'type': 'image'}`` parts (the shape processors' chat templates read, one image
    part per image, in order), and the images read, in the same order."""
    given = _images_given(messages, index)
    texts = [_text_of(m, i, index) for i, m in enumerate(messages)]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    tags = sum(texts[i].count(IMAGE_TAG) for i in users)
    if tags > len(given):
        raise BadImage(
            index,
            "messages",
            f": the user turns have {tags} {IMAGE_TAG} tag(s) but the row gives {len(given)} image(s); "
            f"give one image per tag (Message.images)",
        )
    if given and not users:
        raise BadImage(index, "messages", f": {len(given)} image(s) but no user turn to put them in")
    images = [load_image(value, index, field) for field, value in given]
    untagged = len(given) - tags
    turns = []
    for i, message in enumerate(messages):
        text = texts[i]
        turn = {k: v for k, v in message.items() if k not in ("content", "images")}
        if i not in users:
            turn["content"] = [{"type": "text", "text": text}]
            turns.append(turn)
            continue
        if i == users[0]:
            text = IMAGE_TAG * untagged + text
        parts: list[dict[str, str]] = []
        for k, piece in enumerate(text.split(IMAGE_TAG)):
            if k > 0:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        turn["content"] = parts
        turns.append(turn)
    return turns, images
