"""What each architecture we can write to GGUF looks like there: its name, its tensor names and
its metadata, as llama.cpp's converter writes them and llama.cpp reads them.

One registry, ``GGUF_ARCHITECTURES``, keyed by the Hugging Face ``config.model_type``. Llama,
Qwen2 and Qwen3 share the decoder layout; they differ in the GGUF architecture name, in Llama's
permuted q/k rows (below) and in which optional tensors (q/k/v biases, q/k norms) appear."""

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinkle.utils.errors import UserError

# Tensor types an export may ask for, by the name on the command line.
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")

# Hugging Face parameter name (layer number as {i}) -> GGUF tensor name; the suffix
# (.weight/.bias) is carried over.
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GLOBAL = re.compile(r"(.+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFArch:
    """``name``: ``general.architecture``. ``permute_qk``: llama.cpp runs Llama's rotary
    embedding on adjacent pairs of each head's dimensions, transformers on its two halves, so the
    q and k rows of every head are interleaved on the way in (transformers' GGUF loader undoes
    it on the way out). Qwen2/3 use the halves layout in llama.cpp too and are written as is.
    ``types``: the entries of ``GGUF_TYPES`` this architecture may be written as."""

    name: str
    permute_qk: bool
    types: tuple[str, ...] = GGUF_TYPES


GGUF_ARCHITECTURES = {
    "llama": GGUFArch("llama", permute_qk=True),
    "qwen2": GGUFArch("qwen2", permute_qk=False),
    "qwen3": GGUFArch("qwen3", permute_qk=False),
}


def gguf_arch(model_type: str, gguf_types: tuple[str, ...] = ()) -> GGUFArch:
    """The registry entry for ``model_type``; ``UserError`` naming the supported architectures,
    or the supported types when one of ``gguf_types`` is not among them."""
    arch = GGUF_ARCHITECTURES.get(model_type)
    if arch is None:
        names = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UserError(
            f"cannot write a {model_type!r} model as GGUF; supported architectures: {names} "
            "(export without --gguf for a Hugging Face folder)"
        )
    unknown = [name for name in gguf_types if name not in arch.types]
    if unknown:
        raise UserError(
            f"--gguf-type {','.join(unknown)} is not supported for {model_type}; choose from {', '.join(arch.types)}"
        )
    return arch


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name of a Hugging Face parameter; None for buffers llama.cpp recomputes (rotary
    frequencies). ``UserError`` for a parameter the layout does not know, rather than a file
    that silently lacks it."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    layer = _LAYER.fullmatch(hf_name)
    if layer and layer.group(2) in _LAYER_NAMES:
        return f"blk.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.{layer.group(3)}"
    plain = _GLOBAL.fullmatch(hf_name)
    if plain and plain.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[plain.group(1)]}.{plain.group(2)}"
    raise UserError(f"the model has a tensor {hf_name!r} that has no GGUF name; it cannot be written as GGUF")


def permute_for_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the output rows of each head from [first half, second half] to interleaved pairs
    (row ``j`` of the first half next to row ``j`` of the second). Works on a weight (rows x
    columns) and on a bias alike."""
    head_dim = weight.shape[0] // n_heads
    rows = weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def rope_theta(config: Any) -> float:
    """The rotary base; ``UserError`` for a rope scaling GGUF readers would not reproduce."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise UserError(
            f"cannot write rope scaling {kind!r} to GGUF; only unscaled rotary embeddings are supported"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UserError("the model config has no rope_theta; it cannot be written as GGUF")
    return float(theta)


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
