"""``check_model_folder``: find what makes a model folder unusable before transformers reads it.

A folder with a broken part otherwise fails deep inside ``from_pretrained`` with a traceback, a
multi-line message about tokenizer conversion, or not at all (layers the weights lack are
initialised at random). The checks run cheapest first and stop at the first problem, which
becomes one ``UserError`` line naming the part and the fix:

1. ``config.json``: a JSON object whose ``model_type`` transformers knows and has a causal-LM
   class for, with positive sizes (``vocab_size``, ``hidden_size``, layers, heads);
2. tokenizer files;
3. weight files: present; a safetensors index whose shards exist and hold what it lists; every
   safetensors header readable (a truncated or damaged file);
4. weights that fit the config: tensor shapes and the number of layers, compared with a model
   built on the ``meta`` device from the config (no memory, no weights read).

Nothing is loaded: safetensors files are opened for their headers only. A folder is checked once
per state of its files, so the several loads of one run (tokenizer, model) pay once."""

import functools
import json
import re
from pathlib import Path
from typing import Any

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger(__name__)

# Families the training path is tested on: padding-free packing (``model/packing.py``, and for
# image rows ``model/vision_packing.py``) and the kernels (``kernel/config.py``). Any other causal
# LM that transformers knows loads and trains through the generic path.
TESTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
)
# Any of these lets ``AutoTokenizer`` build a tokenizer without a network.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tokenizer.tiktoken",
)
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# config.json sizes every decoder model has; zero, negative or non-integer ones cannot build it.
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_LAYER = re.compile(r"^(.*\blayers)\.(\d+)\.")
_SHOWN = 3  # names quoted in a message; the rest are counted


def tested_families() -> str:
    return ", ".join(TESTED_MODEL_TYPES)


def _fail(name: str, text: str) -> UserError:
    return UserError(f"model folder {name!r}: {text}")


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def read_config(folder: Path, name: str) -> dict[str, Any]:
    """``config.json`` as a dict, with a ``model_type`` transformers can load as a causal LM."""
    path = folder / "config.json"
    if not path.is_file():
        raise _fail(name, "no config.json; pass a folder with config.json, a .gguf file, or a hub id")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(
            name, f"config.json is not valid JSON ({exc}); restore it from the model's source"
        ) from exc
    if not isinstance(config, dict):
        raise _fail(name, f"config.json holds a {type(config).__name__}, not a JSON object; restore it")
    check_model_type(config, name)
    check_sizes(config, name)
    return config


def check_sizes(config: dict[str, Any], name: str) -> None:
    """The sizes that shape the model (``SIZE_KEYS``, at the top level or in a multimodal
    model's ``text_config``) are positive integers where given: transformers builds a model from
    ``vocab_size`` 0 and fails deep inside a layer's initialisation."""
    parts = [("", config)]
    if isinstance(config.get("text_config"), dict):
        parts.append(("text_config.", config["text_config"]))
    for prefix, part in parts:
        for key in SIZE_KEYS:
            value = part.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise _fail(
                    name,
                    f"config.json has {prefix}{key} {value!r}, which must be a positive integer; "
                    "use the config.json that belongs to these weights",
                )


def check_model_type(config: dict[str, Any], name: str) -> None:
    """A ``model_type`` that transformers knows and loads with ``AutoModelForCausalLM`` (or, for
    multimodal chat models, ``AutoModelForImageTextToText``)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    supported = f"Twinkle trains causal LMs that transformers knows (tested: {tested_families()})"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise _fail(
            name, f'config.json has no "model_type" (e.g. "llama"); {supported}; add the family it belongs to'
        )
    if model_type not in CONFIG_MAPPING_NAMES:
        custom = (
            " and needs the model's own code (auto_map), which Twinkle does not run"
            if "auto_map" in config
            else ""
        )
        raise _fail(
            name,
            f"model_type {model_type!r} is not a family transformers {transformers.__version__} knows{custom}; "
            f"{supported}; fix model_type in config.json or upgrade transformers",
        )
    if (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        raise _fail(
            name,
            f"model_type {model_type!r} is not a causal language model (transformers has no "
            f"AutoModelForCausalLM class for it); {supported}",
        )


def check_tokenizer_files(folder: Path, name: str) -> None:
    present = [f for f in TOKENIZER_FILES if (folder / f).is_file()] or sorted(
        p.name for p in folder.glob("*.tiktoken")
    )
    if not present:
        raise _fail(
            name,
            f"no tokenizer files (one of {', '.join(TOKENIZER_FILES[:3])} or vocab.json + merges.txt); "
            "copy them from the model's source (tokenizer.save_pretrained(folder))",
        )
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file() and not _ends_like_json(tokenizer_json):
        raise _fail(name, "tokenizer.json is cut short or empty; copy it again from the model's source")


def _ends_like_json(path: Path) -> bool:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - 64))
        return handle.read().rstrip().endswith(b"}")


def _no_weights_hint(folder: Path) -> str:
    if (folder / "adapter_model.safetensors").is_file():
        return "; it holds a LoRA adapter: pass the base model as --model-id and this folder as the adapter"
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if ggufs:
        return f"; it holds {ggufs[0]}: pass that .gguf file as --model-id"
    return "; download the weights again"


def safetensors_files(folder: Path, name: str) -> list[Path]:
    """The safetensors files transformers would read, after checking the index names only shards
    that exist; ``[]`` for a ``pytorch_model.bin`` folder. No weight file at all is an error.
    A single ``model.safetensors`` is what transformers reads first, so it wins over an index."""
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS]
    if (folder / SAFETENSORS_INDEX).is_file():
        weight_map = _weight_map(folder / SAFETENSORS_INDEX, name)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise _fail(
                name,
                f"{SAFETENSORS_INDEX} names {len(missing)} of {len(shards)} shard(s) that are missing "
                f"({_some(missing)}); download them again",
            )
        return [folder / s for s in shards]
    if (folder / TORCH_BIN).is_file() or (folder / TORCH_BIN_INDEX).is_file():
        return []
    raise _fail(
        name,
        f"no weight files ({SAFETENSORS}, shards listed in {SAFETENSORS_INDEX}, or {TORCH_BIN})"
        + _no_weights_hint(folder),
    )


def _weight_map(path: Path, name: str) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise _fail(name, f"{path.name} is not a valid index ({exc}); download it again") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(name, f"{path.name} has no weight_map; download it again")
    return weight_map


def read_shapes(files: list[Path], folder: Path, name: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers (the tensors stay on disk)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    held: dict[str, set[str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys = list(handle.keys())
                for key in keys:
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
            reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            raise _fail(
                name, f"weight file {path.name} is damaged or cut short ({reason}); download it again"
            ) from exc
        held[path.name] = set(keys)
    if files != [folder / SAFETENSORS] and (folder / SAFETENSORS_INDEX).is_file():
        weight_map = _weight_map(folder / SAFETENSORS_INDEX, name)
        lost = sorted(k for k, shard in weight_map.items() if k not in held.get(shard, ()))
        if lost:
            raise _fail(
                name,
                f"{SAFETENSORS_INDEX} lists {len(lost)} tensor(s) that their shard does not hold "
                f"({_some(lost)}); download the index and shards again",
            )
    return shapes


def _meta_model(folder: Path) -> Any:
    """The model the config describes, built on the ``meta`` device; None when that is not
    possible here (the check is then skipped, the load itself still reports what it finds)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    if getattr(config, "quantization_config", None) is not None:  # packed weights have other shapes
        return None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        logger.debug("no meta model for %s (%s); weight shapes not checked", folder, exc)
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_weights_match_config(folder: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """The tensors both the checkpoint and the config's model have agree in shape, and the
    checkpoint holds exactly the config's layers. Names the two do not share (a checkpoint
    format that transformers renames on load) are not compared."""
    try:
        model = _meta_model(folder)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise _fail(name, f"config.json cannot be read by transformers ({reason}); restore it") from exc
    if model is None:
        return
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [k for k in expected if k in shapes and shapes[k] != expected[k]]
    if wrong:
        k = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise _fail(
            name,
            f"the weights do not match config.json: {k} is {list(shapes[k])} in the weights but "
            f"{list(expected[k])} by config.json{more}; use the config.json that belongs to these weights",
        )
    _check_layers(name, expected, shapes, getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


def _layers(names: Any) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for key in names:
        match = _LAYER.match(key)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    return found


def _check_layers(name: str, expected: dict, shapes: dict, ignored: list[str]) -> None:
    kept = [k for k in shapes if not any(re.search(pattern, k) for pattern in ignored)]
    have = _layers(kept)
    for prefix, want in _layers(expected).items():
        got = have.get(prefix)
        if got and got != want:
            raise _fail(
                name,
                f"the weights do not match config.json: it describes {len(want)} layer(s) (num_hidden_layers) "
                f"but the weights hold {len(got)} under {prefix}; use the config.json that belongs to these weights",
            )


def _folder_state(folder: Path) -> tuple:
    return tuple(
        sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    )


def check_model_folder(folder: str | Path, name: str | None = None, weights: bool = True) -> None:
    """Raise one ``UserError`` line naming what makes ``folder`` unusable as a causal LM with its
    tokenizer, and how to fix it; return when it is usable. ``name`` is how the user called it
    (default: the path). ``weights=False`` checks the config and tokenizer only.

    The entry point for every command that loads a model folder (training, ``twinkle chat``,
    export, eval); ``resolve_model`` calls it on every folder it returns that came from the user."""
    folder = Path(folder)
    _check(folder.resolve(), name or str(folder), weights, _folder_state(folder))


@functools.lru_cache(maxsize=32)
def _check(folder: Path, name: str, weights: bool, state: tuple) -> None:
    read_config(folder, name)
    check_tokenizer_files(folder, name)
    if not weights:
        return
    files = safetensors_files(folder, name)
    if files:
        check_weights_match_config(folder, name, read_shapes(files, folder, name))
