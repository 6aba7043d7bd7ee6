"""``InputFeature``: one encoded sample, what a template makes of a ``Trajectory``."""

from typing import Any, TypedDict


class InputFeature(TypedDict, total=False):
    """Token lists of one sample (a batch holds them as tensors of shape ``(rows, tokens)``).

    - ``input_ids``: the tokens; ``labels``: the token to predict at each position, ``-100``
      where nothing is learnt (prompt, padding); ``attention_mask``: 1 on tokens, 0 on padding;
    - ``position_ids``: each token's position, from 0 at the start of its sample;
    - ``length``: the number of tokens.

    A preference row, once encoded, is ``{'positive': InputFeature, 'negative': InputFeature}``."""

    input_ids: Any
    labels: Any
    attention_mask: Any
    position_ids: Any
    length: int
