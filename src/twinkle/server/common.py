"""``input_feature_to_datum``: one of twinkle's encoded rows as the Tinker ``Datum`` it means.

Twinkle's row has ``input_ids`` and ``labels`` of the same length, the labels aligned with the
inputs (``labels[k]`` is the token at position ``k`` when it is trained, -100 where it is not),
and the model shifts them once. A Tinker datum is already shifted: ``model_input`` ``x`` and
``target_tokens`` ``y`` with ``y[i]`` predicted at position ``i``. So ``x = input_ids[:-1]``,
``y = input_ids[1:]`` and ``weights[i] = 1`` exactly where ``labels[i + 1]`` is trained (the
assistant's tokens, as the template labelled them), 0 elsewhere. The server turns the datum
back into the same row (``twinkle.server.datums.datum_batch``), so the loss is the same.

A row encoded by a vision-language template also sends its processed images, ``pixel_values``
and ``image_grid_thw``, in ``loss_fn_inputs`` (upstream's layout; the image placeholder tokens
are in ``model_input`` already), which the server checks against those placeholders
(``twinkle.server.images``).

Light on purpose: a client script imports it with numpy and the Tinker SDK only."""

from pathlib import Path
from typing import Any

import numpy as np

IGNORE = -100
BUNDLED_SERVED = "bundled:SmolLM2-135M-Instruct"  # how a server of the bundled model names it


def serves(served: str, asked: str) -> bool:
    """Whether a server serving ``served`` serves ``asked``: the same id (a hub prefix such as
    upstream's ``ms://`` aside), or any name of the bundled model when that is the one served."""
    from twinkle.hub.gguf import BUNDLED_MODEL_NAMES

    bare = asked.split("://", 1)[1] if asked.startswith(("ms://", "hf://")) else asked
    if served in (asked, bare):
        return True
    if served != BUNDLED_SERVED:
        return False
    if asked in BUNDLED_MODEL_NAMES:
        return True
    from twinkle.hub import resolve_model  # the bundled model's folder on this machine

    return Path(asked).expanduser().resolve() == resolve_model(None).resolve()


def local_model_id(served: str) -> str | None:
    """The id this machine loads the served model's tokenizer by (None: the bundled model)."""
    return None if served == BUNDLED_SERVED else served


def _flat(values: Any, what: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ValueError(f"input_feature_to_datum: {what} must be one row of tokens, got shape {array.shape}")
    return array.astype(np.int64)


def shifted(input_ids: Any, labels: Any) -> tuple[list[int], list[int], list[float]]:
    """(model input, targets, weights) of one row: targets shifted once, weight 1 where trained."""
    ids, lab = _flat(input_ids, "input_ids"), _flat(labels, "labels")
    if ids.size != lab.size or ids.size < 2:
        raise ValueError(
            f"input_feature_to_datum: input_ids ({ids.size}) and labels ({lab.size}) must have the same "
            "length, at least 2"
        )
    weights = (lab[1:] != IGNORE).astype(np.float32)
    return ids[:-1].tolist(), ids[1:].tolist(), weights.tolist()


def input_feature_to_datum(input_feature: dict[str, Any]) -> Any:
    """The Tinker ``Datum`` of an encoded row (``input_ids``, ``labels``; other keys such as
    ``attention_mask`` or ``position_ids`` of one unpadded row carry nothing more). A row
    without labels trains every next token."""
    from tinker import types

    ids = input_feature["input_ids"]
    labels = input_feature.get("labels")
    if labels is None:
        labels = ids
    model_input, targets, weights = shifted(ids, labels)
    inputs = {
        "target_tokens": types.TensorData.from_numpy(np.asarray(targets, dtype=np.int64)),
        "weights": types.TensorData.from_numpy(np.asarray(weights, dtype=np.float32)),
    }
    inputs.update(images_of(input_feature))
    return types.Datum(model_input=types.ModelInput.from_ints(model_input), loss_fn_inputs=inputs)


def images_of(input_feature: dict[str, Any]) -> dict[str, Any]:
    """A row's processed images, as upstream's conversion sends them: ``pixel_values``
    (float32, one row per patch) and ``image_grid_thw`` (int64, one ``(t, h, w)`` per image)."""
    from tinker import types

    given = [k for k in ("pixel_values", "image_grid_thw") if input_feature.get(k) is not None]
    if not given:
        return {}
    if len(given) == 1:
        raise ValueError(
            f"input_feature_to_datum: the row has {given[0]} without the other of pixel_values, image_grid_thw"
        )
    out = {}
    for key, dtype in (("pixel_values", np.float32), ("image_grid_thw", np.int64)):
        value = input_feature[key]
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        array = np.asarray(value, dtype=dtype)
        if array.ndim != 2:
            raise ValueError(f"input_feature_to_datum: {key} must be 2-D, got shape {array.shape}")
        out[key] = types.TensorData.from_numpy(np.ascontiguousarray(array))
    return out


__all__ = ["images_of", "input_feature_to_datum", "shifted"]
