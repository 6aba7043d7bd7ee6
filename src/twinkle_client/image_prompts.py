"""Images sent to the server: a Tinker ``ModelInput`` whose text chunks hold the row's tokens
and whose ``ImageChunk``s (PNG bytes) stand where each image's placeholder tokens were. This is
the one way a sample request carries images (``asample`` takes no arrays beside the prompt), and
the way a Gemma 3 / Gemma 4 training row does (its images carry no grid sizes the server could
check sent pixels by; a Qwen-VL row's go in ``loss_fn_inputs``). The server runs its model's own
image processor on each picture and puts the placeholders back, so the pictures must be the ones
the row's ``pixel_values`` were made from.

A trajectory brings them (``Message.images``, read as the template reads them). An encoded row
brings only its processed images; its pictures are rebuilt from them, since each family's
processor resizes a picture in 8-bit pixels, rescales, normalizes and lays the pixels out in a
way that undoes exactly: Qwen-VL cuts the picture into patches on its grid
(``image_grid_thw``), Gemma 3 keeps the resized picture whole, Gemma 4 flattens its patches with
their positions (``image_position_ids``, -1 on the padding). A rebuilt picture is already at the
size the processor resized it to, which the processor keeps as it is, except where Gemma 4's
aspect-ratio fit of the rebuilt picture lands on another patch grid (long, thin pictures). Each
rebuilt picture is therefore run through the processor here and must give the row's numbers
back; one that does not is refused in one line rather than sent with other numbers than the row
holds."""

import io
from typing import Any

import numpy as np

from twinkle.utils.errors import UserError

IMAGES = ("pixel_values", "image_grid_thw")  # a Qwen-VL row's
ROW_IMAGES = (*IMAGES, "image_position_ids")  # what any family's row holds its images in


def _array(value: Any, dtype: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


def png(picture: Any) -> bytes:
    out = io.BytesIO()
    picture.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def _levels(values: np.ndarray, processor: Any, channels_at: int, where: str, j: int) -> np.ndarray:
    """``values`` (float64, RGB on axis ``channels_at``) undone through the processor's
    normalization and rescaling back to 8-bit levels; ones that are not 8-bit levels are refused."""
    shape = [1] * values.ndim
    shape[channels_at] = 3
    mean, std = np.zeros(3), np.ones(3)
    if getattr(processor, "do_normalize", True):
        mean = np.broadcast_to(np.asarray(processor.image_mean, dtype=np.float64), (3,))
        std = np.broadcast_to(np.asarray(processor.image_std, dtype=np.float64), (3,))
    scale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
    levels = np.rint((values * std.reshape(shape) + mean.reshape(shape)) / scale)
    if levels.min() < -0.5 or levels.max() > 255.5:
        raise UserError(
            f"{where}: image {j}'s pixel_values are not 8-bit pixels through this model's normalization; "
            "sample the trajectory (Message.images) instead"
        )
    return levels.clip(0, 255).astype(np.uint8)


def _qwen_pictures(row: dict[str, Any], processor: Any, where: str) -> list[np.ndarray]:
    """Qwen-VL: each image's patches (``image_grid_thw`` of them, merged in ``merge_size``
    squares) put back on its grid, ``(height, width, 3)`` 8-bit arrays."""
    pixels = _array(row["pixel_values"], np.float32)
    grids = _array(row["image_grid_thw"], np.int64).reshape(-1, 3)
    p, m = int(processor.patch_size), int(getattr(processor, "merge_size", 1))
    t_patch = int(getattr(processor, "temporal_patch_size", 1))
    if pixels.ndim != 2 or pixels.shape[1] != 3 * t_patch * p * p:
        raise UserError(
            f"{where}: pixel_values of shape {list(pixels.shape)} are not this model's image patches "
            f"(width {3 * t_patch * p * p}); encode the row with the served model's template"
        )
    patches_of = [int(t) * int(h) * int(w) for t, h, w in grids.tolist()]
    if sum(patches_of) != len(pixels):
        raise UserError(
            f"{where}: image_grid_thw covers {sum(patches_of)} patches but pixel_values holds {len(pixels)}"
        )
    out, start = [], 0
    for j, (t, gh, gw) in enumerate(grids.tolist()):
        if t != 1 or gh % m or gw % m:
            raise UserError(f"{where}: image {j} has grid {t}x{gh}x{gw}; only still images are sampled")
        patches = pixels[start : start + gh * gw].astype(np.float64)
        start += gh * gw
        patches = patches.reshape(gh // m, gw // m, m, m, 3, t_patch, p, p)[:, :, :, :, :, 0]
        image = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
        out.append(_levels(image, processor, 0, where, j).transpose(1, 2, 0))
    return out


def _gemma3_pictures(row: dict[str, Any], processor: Any, where: str) -> list[np.ndarray]:
    """Gemma 3: ``pixel_values`` are the resized images themselves, ``(images, 3, H, W)``."""
    pixels = _array(row["pixel_values"], np.float64)
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise UserError(
            f"{where}: pixel_values of shape {list(pixels.shape)} are not (images, 3, height, width) "
            "images; encode the row with the served model's template"
        )
    return [_levels(image, processor, 0, where, j).transpose(1, 2, 0) for j, image in enumerate(pixels)]


def _gemma4_pictures(row: dict[str, Any], processor: Any, where: str) -> list[np.ndarray]:
    """Gemma 4: each image's ``patch_size`` patches (``(p, p, 3)`` flattened) put back at their
    ``image_position_ids`` ``(x, y)``; positions of -1 are the budget's padding."""
    if row.get("image_position_ids") is None:
        raise UserError(
            f"{where} has pixel_values without image_position_ids; encode the row and its images together"
        )
    pixels = _array(row["pixel_values"], np.float64)
    positions = _array(row["image_position_ids"], np.int64)
    p = int(processor.patch_size)
    if pixels.ndim != 3 or pixels.shape[2] != 3 * p * p or positions.shape != (*pixels.shape[:2], 2):
        raise UserError(
            f"{where}: pixel_values {list(pixels.shape)} and image_position_ids {list(positions.shape)} are not "
            f"this model's (images, patches, {3 * p * p}) patches and (images, patches, 2) positions"
        )
    out = []
    for j, (patches, at) in enumerate(zip(pixels, positions, strict=True)):
        real = at[:, 0] >= 0
        xs, ys = at[real, 0], at[real, 1]
        if not real.any() or real.sum() != (xs.max() + 1) * (ys.max() + 1):
            raise UserError(f"{where}: image {j}'s image_position_ids do not cover a whole grid of patches")
        image = np.zeros((ys.max() + 1, p, xs.max() + 1, p, 3))
        image[ys, :, xs] = patches[real].reshape(-1, p, p, 3)
        out.append(_levels(image.reshape((ys.max() + 1) * p, (xs.max() + 1) * p, 3), processor, 2, where, j))
    return out


def gemma(template: Any) -> bool:
    """Whether the template's family writes images without grid sizes (Gemma 3, Gemma 4): its
    rows' images travel as ``ImageChunk``s only, training rows' too."""
    from twinkle.template.gemma import GemmaVisionTemplate

    return isinstance(template, GemmaVisionTemplate)


def image_keys(template: Any) -> tuple[str, ...]:
    """The keys a row this template encoded holds its processed images in."""
    from twinkle.template.gemma import Gemma4Template

    if isinstance(template, Gemma4Template):
        return ("pixel_values", "image_position_ids")
    return ("pixel_values",) if gemma(template) else IMAGES


def rebuilt_pictures(row: dict[str, Any], template: Any, where: str) -> tuple[list[Any], list[int]]:
    """``(pictures, token counts)``: the PIL pictures the row's processed images were made from
    (see the module's docstring), each checked by processing it again, and how many
    placeholder tokens each stands for."""
    from PIL import Image

    from twinkle.template.gemma import Gemma4Template

    processor = template.processor.image_processor
    keys = image_keys(template)
    rebuild = _gemma4_pictures if isinstance(template, Gemma4Template) else _gemma3_pictures
    arrays = rebuild(row, processor, where) if gemma(template) else _qwen_pictures(row, processor, where)
    pictures = [Image.fromarray(a, "RGB") for a in arrays]
    again, counts = template.process_images(pictures)
    for k in keys:
        given, made = _array(row[k], np.float64), again[k].numpy()
        same = given.shape == made.shape and (
            np.allclose(made, given, rtol=0, atol=1e-5)
            if k == "pixel_values"
            else np.array_equal(made, given)
        )
        if not same:
            raise UserError(
                f"{where}: its pictures cannot be rebuilt from its {k} (the model's processor makes other "
                "numbers of them); send the trajectory (Message.images) instead"
            )
    return pictures, counts


def counts_of(row: dict[str, Any], template: Any) -> list[int]:
    """Each image's count of placeholder tokens as the row's processed images say."""
    from twinkle.template.gemma import Gemma3Template

    if isinstance(template, Gemma3Template):
        return [template.image_seq_length] * len(_array(row["pixel_values"], np.float32))
    if gemma(template):
        kernel = int(template.processor.image_processor.pooling_kernel_size) ** 2
        real = _array(row["image_position_ids"], np.int64)[..., 0] >= 0
        return [int(n) // kernel for n in real.sum(axis=1)]
    return [template.image_tokens(g) for g in _array(row["image_grid_thw"], np.int64).reshape(-1, 3)]


def model_input(ids: list[int], template: Any, pictures: list[Any], counts: list[int], where: str) -> Any:
    """``ids`` as text chunks with ``pictures[j]`` an ``ImageChunk`` in place of image ``j``'s run
    of ``counts[j]`` placeholder tokens (its ``expected_tokens``)."""
    from tinker import types

    image_id = int(template.image_token_id)
    chunks: list[Any] = []
    last, at = 0, 0
    for j, (picture, count) in enumerate(zip(pictures, counts, strict=True)):
        at = ids.index(image_id, last) if image_id in ids[last:] else -1
        if at < 0 or ids[at : at + count] != [image_id] * count:
            raise UserError(
                f"{where}: its input_ids do not hold image {j}'s {count} placeholder tokens "
                f"{template.image_token} where its images say; encode the row and its images together"
            )
        if at > last:
            chunks.append(types.EncodedTextChunk(tokens=ids[last:at]))
        chunks.append(types.ImageChunk(data=png(picture), format="png", expected_tokens=count))
        last = at + count
    if image_id in ids[last:]:
        found = ids.count(image_id) - sum(counts)
        raise UserError(
            f"{where}: {found} image placeholder token(s) {template.image_token} beyond its "
            f"{len(counts)} image(s); give each image its {' and '.join(image_keys(template))}"
        )
    if last < len(ids):
        chunks.append(types.EncodedTextChunk(tokens=ids[last:]))
    return types.ModelInput(chunks=chunks)


def has_images(row: Any) -> bool:
    return isinstance(row, dict) and any(row.get(k) is not None for k in ROW_IMAGES)


def images_in(row: dict[str, Any], template: Any, where: str) -> dict[str, Any]:
    """The row's processed images under the keys ``template`` writes them (``image_keys``),
    all of them or a one-line error."""
    keys = image_keys(template)
    given = [k for k in ROW_IMAGES if row.get(k) is not None]
    if given and not set(keys) <= set(given):
        raise UserError(f"{where} has {given[0]} without the other of {', '.join(keys)}")
    return {k: row[k] for k in keys}


def served_template(served: str) -> Any:
    """The vision-language template the server places the served model's images with, for rows
    that bring images without a template set; None for a model the server reads text only."""
    from twinkle.server.common import local_model_id
    from twinkle.server.images import TEMPLATES, load_vision

    vision = load_vision(local_model_id(served))
    if vision is not None and vision.template is None:
        raise UserError(
            f"the served model is {vision.model_type}; the server places images for "
            f"{', '.join(sorted(TEMPLATES))} models"
        )
    return None if vision is None else vision.template


def prompt_input(prompt: Any, template: Any, where: str) -> tuple[Any, list[int], dict[str, Any]]:
    """``(ModelInput, input_ids, images)`` of a prompt: token ids, a ``ModelInput`` (sent as it
    is), or an encoded row (``input_ids``, and its processed images under the keys its family
    writes, ``image_keys``, placed as ``model_input`` says). ``template``: a callable giving the
    vision-language template, called only for a row with images. ``images``: the row's
    processed images, empty without."""
    from tinker import types

    if isinstance(prompt, types.ModelInput):
        return prompt, prompt.to_ints() if all(c.type == "encoded_text" for c in prompt.chunks) else [], {}
    if not isinstance(prompt, dict):
        ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        return types.ModelInput.from_ints(ids), ids, {}
    if "input_ids" not in prompt:
        raise UserError(f"{where} has no input_ids; encode it first (set_template, or Template.encode)")
    ids = _array(prompt["input_ids"], np.int64).reshape(-1).tolist()
    if not has_images(prompt):
        return types.ModelInput.from_ints(ids), ids, {}
    vl = template()
    images = images_in(prompt, vl, where)
    pictures, counts = rebuilt_pictures(prompt, vl, where)
    return model_input(ids, vl, pictures, counts, where), ids, images


def trajectory_input(trajectory: Any, template: Any, where: str) -> tuple[Any, list[int], dict[str, Any]]:
    """``prompt_input``'s triple of a trajectory, encoded by ``template`` with its generation
    prompt; its images (``Message.images``) go as they are read, not rebuilt."""
    from tinker import types

    from twinkle.template.images import place_images
    from twinkle.template.rows import messages_of, without_empty_reply

    row = template.encode(trajectory, add_generation_prompt=True)
    if row is None:
        raise UserError(f"{where}: its prompt is longer than the template's max_length and was dropped")
    ids = _array(row["input_ids"], np.int64).reshape(-1).tolist()
    if not has_images(row):
        return types.ModelInput.from_ints(ids), ids, {}
    _, pictures = place_images(without_empty_reply(messages_of(trajectory)[0]))
    images = images_in(row, template, where)
    return model_input(ids, template, pictures, counts_of(row, template), where), ids, images


def training_input(row: dict[str, Any], template: Any, where: str, trajectory: Any = None) -> Any:
    """The ``ModelInput`` of a training row's shifted input (``input_ids[:-1]``) with each image an
    ``ImageChunk``, for a family whose images travel that way only (``gemma``); the targets stay
    the row's tokens (the server puts the placeholders back before it reads them). The pictures
    are ``trajectory``'s (``Message.images``) where the row was encoded from it, else rebuilt."""
    from twinkle.template.images import place_images
    from twinkle.template.rows import messages_of

    images_in(row, template, where)
    ids = _array(row["input_ids"], np.int64).reshape(-1).tolist()
    if trajectory is None:
        pictures, counts = rebuilt_pictures(row, template, where)
    else:
        pictures, counts = place_images(messages_of(trajectory)[0])[1], counts_of(row, template)
    return model_input(ids[:-1], template, pictures, counts, where)
