"""Write a causal LM (its config, tensors and tokenizer) into one GGUF file: ``write_gguf``.

The file follows the GGUF format (gguf PyPI package's ``GGUFWriter``) with llama.cpp's key and
tensor names (``gguf_arch``). Tensors are streamed: the header lists every tensor's name, shape
and type first, then each tensor is encoded and written in turn, so the file never sits in
memory as a whole next to the model."""

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from twinkle.export.gguf_arch import (
    GGUFArch,
    gguf_arch,
    gguf_tensor_name,
    head_dim,
    permute_for_rope,
    rope_theta,
)
from twinkle.export.gguf_tokenizer import tokenizer_metadata, write_tokenizer
from twinkle.utils.logger import get_logger

logger = get_logger(__name__)

Q = gguf.GGMLQuantizationType
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_MAIN_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}


def tensor_type(shape: tuple[int, ...], gguf_type: str) -> "gguf.GGMLQuantizationType":
    """The GGUF type of one tensor in a file of ``gguf_type``. As in llama.cpp, 1-D tensors
    (norms, biases) stay F32 whatever the file type, and a matrix whose rows are not a whole
    number of Q8_0 blocks (32 values) is written as F16."""
    if len(shape) == 1:
        return Q.F32
    main = _MAIN_TYPES[gguf_type]
    if main == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16
    return main


def _encode(array: np.ndarray, qtype: "gguf.GGMLQuantizationType") -> np.ndarray:
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def _nbytes(shape: tuple[int, ...], qtype: "gguf.GGMLQuantizationType") -> int:
    return int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))


def _gguf_tensors(
    state: Mapping[str, torch.Tensor], config: Any, arch: GGUFArch
) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """(GGUF name, tensor, heads to permute its rows over or None), in file order. A tied
    ``lm_head`` is left out: without ``output.weight`` readers use the embedding, as llama.cpp
    writes such models."""
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_tensor_name(hf_name)
        if name is None:
            continue
        heads = None
        if arch.permute_qk and ".attn_q." in name:
            heads = n_heads
        elif arch.permute_qk and ".attn_k." in name:
            heads = n_kv
        yield name, tensor, heads


def _as_array(tensor: torch.Tensor, heads: int | None) -> np.ndarray:
    array = tensor.detach().to("cpu", torch.float32).numpy()
    return array if heads is None else permute_for_rope(array, heads)


def _write_metadata(writer: gguf.GGUFWriter, config: Any, name: str, gguf_type: str) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(_FILE_TYPES[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _first_id(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        return value[0] if value else None
    return value


def write_gguf(
    path: str | Path,
    state: Mapping[str, torch.Tensor],
    config: Any,
    tokenizer: Any,
    gguf_type: str = "f16",
    name: str | None = None,
) -> Path:
    """Write ``state`` (a Hugging Face state dict of a ``config.model_type`` the registry knows)
    with ``config`` and ``tokenizer`` to ``path`` as one GGUF file of ``gguf_type``.

    Raises ``UserError`` for an architecture, type, rope scaling or tokenizer GGUF readers would
    not reproduce, before anything is written. The file is written under a temporary name and
    renamed at the end, so a failure leaves no partial file at ``path``."""
    path = Path(path)
    arch = gguf_arch(config.model_type, (gguf_type,))
    meta = tokenizer_metadata(tokenizer, config.vocab_size, _first_id(getattr(config, "eos_token_id", None)))
    tensors = list(_gguf_tensors(state, config, arch))
    plan = [
        (tensor_name, tuple(t.shape), tensor_type(tuple(t.shape), gguf_type)) for tensor_name, t, _ in tensors
    ]
    fallback = [tensor_name for tensor_name, _, qtype in plan if qtype == Q.F16 and gguf_type == "q8_0"]
    if fallback:
        logger.warning(
            "%d tensors have rows that are not a multiple of 32 and are written as F16", len(fallback)
        )

    rope_theta(config)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(tmp, arch.name)
    try:
        _write_metadata(writer, config, name or path.stem, gguf_type)
        write_tokenizer(writer, meta)
        for tensor_name, shape, qtype in plan:
            writer.add_tensor_info(
                tensor_name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # The header fixed the order; each tensor is converted only now, one at a time.
        for (_, _, qtype), (_, tensor, heads) in zip(plan, tensors, strict=True):
            writer.write_tensor_data(_encode(_as_array(tensor, heads), qtype))
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
