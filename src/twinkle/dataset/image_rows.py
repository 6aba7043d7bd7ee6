"""Image rows in a table of rows (``Dataset``, on Arrow): what ``map`` stores of each image, what
``encode`` stores of the image processor's tensors, and how a read gives those tensors back.

Arrow holds one type per column and cannot hold a PIL image (``datasets`` would store its
attributes and lose the picture), and ``datasets`` writes turns whose keys differ as JSON, which
holds no bytes. ``map`` therefore stores every image of a row's ``messages`` as text: a path (or
a ``data:`` URI) as it is, bytes and a ``{'bytes': ..., 'path': ...}`` record (what Hugging Face
``datasets`` gives for an ``Image(decode=False)`` column) as a base64 ``data:image/...`` URI of
those bytes, a PIL image as the URI of the PNG of its RGB pixels (lossless, and RGB is what the
template reads of any image). A turn given as content parts becomes its text with ``<image>``
tags and the parts' images (``tagged_messages``), because a column cannot mix text and lists.
``encode`` decodes the images then, as ``LazyDataset`` does when a row is read, so a bad image
is a bad row of ``encode``: named, or counted and dropped with ``skip_bad_rows``."""

import base64
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets

from twinkle.preprocessor.base import BadRow
from twinkle.template.images import BadImage, image_fields, load_image, tagged_messages

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


def _holds_images(messages: Any, index: int) -> bool:
    try:
        return isinstance(messages, list) and bool(image_fields(messages, index))
    except BadImage:
        return False


def _value_type(tensor: Any) -> str:
    """The Arrow value type that keeps ``tensor``'s numbers exactly (``bfloat16`` widened)."""
    name = str(tensor.dtype).removeprefix("torch.")
    return "float32" if name == "bfloat16" else name


def _nested(tensor: Any) -> Any:
    feature: Any = datasets.Value(_value_type(tensor))
    for _ in range(tensor.ndim):
        feature = datasets.List(feature)
    return feature


def image_features(data: datasets.Dataset, template: Any) -> datasets.Features:
    """The columns a vision template's samples add (``pixel_values``, ``image_grid_thw``, ...),
    typed from the first row whose images encode: a table needs its columns' types before
    the rows are written. Empty when no row holds a readable image."""
    from twinkle.utils.errors import UserError

    for index in range(len(data)):
        messages = data[index].get("messages")
        if not _holds_images(messages, index):
            continue
        try:
            out = template.encode(messages, index=index)
        except UserError:  # a bad row: encoding names it in its turn
            continue
        if out is not None:
            return datasets.Features(
                {key: _nested(value) for key, value in out.items() if hasattr(value, "ndim")}
            )
    return datasets.Features({})


def to_columns(sample: dict[str, Any], features: datasets.Features) -> dict[str, Any]:
    """The image tensors of ``sample`` as nested lists, None where the row has none."""
    return {key: sample[key].tolist() if key in sample else None for key in features}


def read_back(row: dict[str, Any], features: datasets.Features) -> dict[str, Any]:
    """A stored row's image columns as the tensors the template gave (a row without images
    holds none of them, as the template's own sample does)."""
    import torch

    for key, feature in features.items():
        value = row.pop(key, None)
        while isinstance(feature, datasets.List):
            feature = feature.feature
        if value is not None:
            row[key] = torch.tensor(value, dtype=getattr(torch, feature.dtype))
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
