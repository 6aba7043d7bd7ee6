"""The tokenizer of a GGUF file: ``tokenizer.ggml.*`` metadata for a byte-level BPE tokenizer
(the GPT-2 family: SmolLM, Llama 3, Qwen), under llama.cpp's key names.

GGUF stores no ``tokenizer.json``. It stores the vocabulary in id order with a type per token,
the merges, the special token ids and a name for the pre-tokenizer (``tokenizer.ggml.pre``)
that tells the reader how to split text before the merges run; that name is read off the
tokenizer's own pre-tokenizer here."""

import json
from dataclasses import dataclass, field
from typing import Any

import gguf

from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger(__name__)

# The split patterns of tokenizer families llama.cpp names; anything else splits like GPT-2.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_NAMES = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


@dataclass
class TokenizerMetadata:
    """Everything ``write_tokenizer`` puts into the file, kept apart so tests can read it."""

    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None


def _pre_tokenizer_name(pre: dict | None) -> str:
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") if step else None for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        name = _SPLIT_NAMES.get(steps[0].get("pattern", {}).get("Regex"))
        if name:
            return name
    logger.warning(
        "the tokenizer's pre-tokenizer (%s) has no llama.cpp name; writing tokenizer.ggml.pre=default, "
        "so GGUF readers may split text differently from the Hugging Face tokenizer",
        kinds,
    )
    return "default"


def _merges(model: dict) -> list[str]:
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]


def _tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """The vocabulary in id order, padded to the embedding's rows with unused placeholders."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if by_id and max(by_id) >= vocab_size:
        raise UserError(
            f"the tokenizer has token id {max(by_id)} but the model only {vocab_size} embedding rows; "
            "they do not belong together"
        )
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index].content)
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(kind) for kind in types]


def _adds(tokenizer: Any) -> tuple[bool, bool]:
    """Whether encoding adds a BOS / an EOS, measured rather than read from a flag that not
    every tokenizer class keeps."""
    ids = tokenizer("a").input_ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return bool(ids) and bos is not None and ids[0] == bos, bool(ids) and eos is not None and ids[-1] == eos


def tokenizer_metadata(tokenizer: Any, vocab_size: int, eos_fallback: int | None = None) -> TokenizerMetadata:
    """Read the metadata off a fast tokenizer; ``UserError`` when it is not byte-level BPE.
    ``eos_fallback`` (the model config's EOS) is used when the tokenizer names none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model", {})
    decoder = spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or model.get("byte_fallback"):
        found = model.get("type") or type(tokenizer).__name__
        raise UserError(
            f"only byte-level BPE tokenizers (GPT-2 style) can be written to GGUF; this one is {found}"
        )
    tokens, types = _tokens(tokenizer, vocab_size)
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_fallback,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
    }
    add_bos, add_eos = _adds(tokenizer)
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return TokenizerMetadata(
        pre=_pre_tokenizer_name(spec.get("pre_tokenizer")),
        tokens=tokens,
        token_types=types,
        merges=_merges(model),
        special_ids={name: int(index) for name, index in special.items() if index is not None},
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template if isinstance(template, str) else None,
    )


def write_tokenizer(writer: gguf.GGUFWriter, meta: TokenizerMetadata) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta.pre)
    writer.add_token_list(meta.tokens)
    writer.add_token_types(meta.token_types)
    writer.add_token_merges(meta.merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for name, index in meta.special_ids.items():
        adders[name](index)
    writer.add_add_bos_token(meta.add_bos)
    writer.add_add_eos_token(meta.add_eos)
    if meta.chat_template:
        writer.add_chat_template(meta.chat_template)
