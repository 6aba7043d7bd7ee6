"""Load (once per process) the tokenizer that belongs to a model id."""

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_id: str | None) -> Any:
    from transformers import AutoTokenizer

    from twinkle.hub import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model_id)))
