"""Ship a fine-tuned model: a checkpoint's LoRA adapter merged into its base, written as a
Hugging Face folder and as GGUF files that llama.cpp, Ollama and transformers load.

Public names:

- ``export_checkpoint(adapter, output, ...)``: the whole export (``twinkle export``); an
  ``ExportResult`` naming what was written.
- ``write_gguf(path, state, config, tokenizer, gguf_type)``: one GGUF file from a state dict.
- ``GGUF_TYPES``, ``GGUF_ARCHITECTURES``: the tensor types and architectures GGUF export writes.
"""

from twinkle.export.export import GGUF_SUBDIR, ExportResult, export_checkpoint, gguf_file_name
from twinkle.export.gguf_arch import GGUF_ARCHITECTURES, GGUF_TYPES
from twinkle.export.gguf_writer import write_gguf

__all__ = [
    "ExportResult",
    "GGUF_SUBDIR",
    "export_checkpoint",
    "gguf_file_name",
    "write_gguf",
    "GGUF_ARCHITECTURES",
    "GGUF_TYPES",
]
