"""``export_checkpoint``: a checkpoint's adapter merged into its base, written as a Hugging Face
folder and, on request, as GGUF files beside it.

Every check that can fail on bad input (the adapter, the base, the output folder, the GGUF
architecture, type, rope and tokenizer) runs before the merge, so a mistake costs seconds, not a
merge. The folder is built under a temporary sibling name and renamed into place at the end, with
the permissions the umask gives a new folder, and ``.twinkle-export`` in it (``output.py``: what
``overwrite`` may replace: an earlier export, never a folder of other files). An existing folder
is replaced only once the new one is complete, and a failure at any point leaves no half-written
output."""

from dataclasses import dataclass, field
from pathlib import Path

from twinkle.export.gguf_arch import gguf_arch, rope_theta
from twinkle.export.gguf_tokenizer import tokenizer_metadata
from twinkle.export.gguf_writer import write_gguf
from twinkle.export.merge import DTYPES, base_dtype, load_tokenizer, merge_adapter, save_merged
from twinkle.export.output import check_output, write_marker
from twinkle.export.source import ExportSource, find_source
from twinkle.hub import check_adapter_folder
from twinkle.utils.errors import UserError
from twinkle.utils.fileio import atomic_dir
from twinkle.utils.logger import get_logger

logger = get_logger(__name__)


# The GGUF files go into a subfolder: transformers' tokenizer loader, given ``gguf_file`` in a
# folder that also holds ``tokenizer.json``, builds the tokenizer from ``tokenizer.json`` and drops
# the special tokens and the chat template, so the GGUF's own tokenizer would never be read.
GGUF_SUBDIR = "gguf"


@dataclass
class ExportResult:
    """``folder``: the Hugging Face folder. ``gguf_files``: one per requested type, in its
    ``gguf/`` subfolder."""

    folder: Path
    dtype: str
    gguf_files: list[Path] = field(default_factory=list)


def gguf_file_name(folder_name: str, gguf_type: str) -> str:
    """``<folder name>.<TYPE>.gguf``, the type spelled as llama.cpp names files (F16, Q8_0)."""
    return f"{folder_name}.{gguf_type.upper()}.gguf"


def _check_not_inside(output: Path, source: ExportSource, given: str) -> None:
    """Replacing ``output`` must not delete what the export reads."""
    for what, folder in (("checkpoint", source.adapter_dir), ("base model", source.base_dir)):
        if folder.resolve().is_relative_to(output.resolve()):
            raise UserError(f"--output {given} holds the {what} it exports; choose another folder")


def _marker_info(source: ExportSource, dtype: str, gguf_types: tuple[str, ...]) -> dict:
    return {
        "checkpoint": str(source.adapter_dir),
        "base_model": source.base_id,
        "dtype": dtype,
        "gguf_types": list(gguf_types),
    }


def _check_gguf(source: ExportSource, gguf_types: tuple[str, ...]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source.base_dir))
    gguf_arch(config.model_type, gguf_types)
    rope_theta(config)
    tokenizer_metadata(load_tokenizer(source), config.vocab_size)


def export_checkpoint(
    adapter: str,
    output: str,
    *,
    model_id: str | None = None,
    gguf_types: tuple[str, ...] = (),
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
) -> ExportResult:
    """Merge the adapter in ``adapter`` (a checkpoint folder) into its base (``model_id``, else
    the one the checkpoint records) and write ``output``: the merged model as safetensors in
    ``dtype`` (None: the base's dtype), its config, generation config and tokenizer, plus one
    ``gguf/<output name>.<TYPE>.gguf`` per entry of ``gguf_types``. ``UserError`` on bad input."""
    out = Path(output).expanduser().absolute()
    check_output(out, output, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    source = find_source(adapter, model_id)
    check_adapter_folder(source.adapter_dir)  # a config whose rank is not its tensors' says so here
    _check_not_inside(out, source, output)
    if gguf_types:
        _check_gguf(source, gguf_types)
    dtype = dtype or base_dtype(source.base_dir)

    logger.info("merging %s into %s (%s)", source.adapter_dir, source.base_id, dtype)
    model = merge_adapter(source, dtype)
    tokenizer = load_tokenizer(source)
    result = ExportResult(out, dtype)
    try:
        with atomic_dir(out) as tmp:
            save_merged(model, tokenizer, tmp, max_shard_size)
            state = model.state_dict()
            for gguf_type in gguf_types:
                name = gguf_file_name(out.name, gguf_type)
                (tmp / GGUF_SUBDIR).mkdir(exist_ok=True)
                write_gguf(tmp / GGUF_SUBDIR / name, state, model.config, tokenizer, gguf_type, name=out.name)
                result.gguf_files.append(out / GGUF_SUBDIR / name)
            write_marker(tmp, _marker_info(source, dtype, gguf_types))
    except OSError as exc:
        raise UserError(f"could not write {output} ({exc.strerror or exc}); nothing was written") from exc
    logger.info("wrote %s", out)
    return result
