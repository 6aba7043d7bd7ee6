"""Image rows in a table of rows (``Dataset``, on Arrow): what ``map`` stores of each image, what
``encode`` keeps of an image row, and how a read makes the image processor's tensors.

Arrow holds one type per column and cannot hold a PIL image (``datasets`` would store its
attributes and lose the picture), and ``datasets`` writes turns whose keys differ as JSON, which
holds no bytes. ``map`` therefore stores every image of a row's ``messages`` as text: a path (or
a ``data:`` URI) as it is, bytes and a ``{'bytes': ..., 'path': ...}`` record (what Hugging Face
``datasets`` gives for an ``Image(decode=False)`` column) as a base64 ``data:image/...`` URI of
those bytes, a PIL image as the URI of the PNG of its RGB pixels (lossless, and RGB is what the
template reads of any image). A turn given as content parts becomes its text with ``<image>``
tags and the parts' images (``tagged_messages``), because a column cannot mix text and lists.

``encode`` decodes every image and runs the template on it, so a bad image is a bad row of
``encode`` (named, or counted and dropped with ``skip_bad_rows``), but keeps the row's pictures
as stored (``IMAGES``) rather than the processor's tensors: those are many times the size of a
compressed picture (a Gemma 4 image is 7.4 MiB of float32 patches), and a read makes them again
(``with_pixels``), equal to what ``LazyDataset`` gives for the row."""

import base64
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets

from twinkle.preprocessor.base import BadRow
from twinkle.template.images import BadImage, load_image, tagged_messages

SIDES = ("positive", "negative")  # a preference row's trajectories (twinkle.dataset.pairs)


_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"RIFF", "webp"))


def _data_uri(data: bytes) -> str:
    """``data`` as a base64 ``data:image/<format>`` URI (``load_image`` reads the format from
    the bytes themselves; the name is for a reader of the rows)."""
    kind = next((name for magic, name in _MAGIC if data.startswith(magic)), "unknown")
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def stored_image(value: Any, index: int | None, field: str) -> str | None:
    """``value`` (``Message.images``' kinds) as a path or a data URI; None stays None (encoding
    names it). Another kind is a ``BadImage`` here: a table could not keep it."""
    pil = sys.modules.get("PIL.Image")  # a PIL image can only exist once PIL is imported
    if pil is not None and isinstance(value, pil.Image):
        return _data_uri(_png(value))
    if isinstance(value, bytes | bytearray | memoryview):
        return _data_uri(bytes(value))
    if isinstance(value, str | Path):
        return str(value)
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        return stored_image(value.get("bytes") or value.get("path"), index, field)
    if value is None:
        return None
    load_image(value, index, field)  # raises BadImage naming what the value is
    raise AssertionError(f"load_image read {type(value).__name__}, which stored_image does not store")


def _stored_messages(messages: Any, index: int | None) -> Any:
    if not isinstance(messages, list | tuple):
        return messages  # the template's check names what is wrong with it
    turns = []
    for i, message in enumerate(tagged_messages(list(messages), index)):
        images = message.get("images") if isinstance(message, Mapping) else None
        if isinstance(images, list | tuple):
            stored = [stored_image(v, index, f"messages[{i}].images[{j}]") for j, v in enumerate(images)]
            message = {**message, "images": stored}
        turns.append(message)
    return turns


def storable(row: dict[str, Any], index: int | None) -> dict[str, Any]:
    """``row`` with the images of its ``messages`` (and of a preference row's trajectories) in
    the stored form (module docstring). A value that cannot be an image is a ``BadRow``."""
    try:
        if "messages" in row:
            row = {**row, "messages": _stored_messages(row["messages"], index)}
        for side in SIDES:
            value = row.get(side)
            if isinstance(value, Mapping) and "messages" in value:
                row = {**row, side: {**value, "messages": _stored_messages(value["messages"], index)}}
    except BadImage as exc:
        raise BadRow(exc.index, exc.field, exc.text) from None
    return row


IMAGES = "images"  # an encoded row's pictures as stored, in the order the template placed them
IMAGES_FEATURE = datasets.List(datasets.Value("string"))


def stored_images(messages: list[dict[str, Any]], index: int | None) -> list[str]:
    """The row's images in the order the template places them (turn order, each turn's content
    parts first, as ``place_images`` reads them), stored as ``stored_image`` stores them."""
    values = [v for turn in tagged_messages(messages, index) for v in (turn.get("images") or [])]
    return [stored_image(v, index, f"{IMAGES}[{k}]") for k, v in enumerate(values)]


def with_pixels(row: dict[str, Any], template: Any, index: int | None) -> dict[str, Any]:
    """An encoded row read back: its stored pictures through the template's image processor,
    the tensors the template's own sample holds (``pixel_values``, ``image_grid_thw``, ...)."""
    images = row.pop(IMAGES, None)
    if images:
        pictures = [load_image(v, index, f"{IMAGES}[{k}]") for k, v in enumerate(images)]
        vision, _ = template.process_images(pictures, index)
        row.update(vision)
    return row


def storable_columns(columns: dict[str, list], indices: list[int]) -> dict[str, list]:
    """``storable`` for a batch as column lists (row ``k`` named ``indices[k]`` when the batch
    kept its rows, else by its place in the batch)."""
    keys = [key for key in ("messages", *SIDES) if key in columns]
    if not keys:
        return columns
    n = len(columns[keys[0]])
    names = indices if len(indices) == n else list(range(n))
    rows = [storable({key: columns[key][k] for key in keys}, names[k]) for k in range(n)]
    return {**columns, **{key: [row[key] for row in rows] for key in keys}}
