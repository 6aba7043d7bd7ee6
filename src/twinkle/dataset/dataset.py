"""``Dataset``: load -> map(preprocessor) -> set_template -> encode, on Hugging Face ``datasets``."""

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import datasets

from twinkle.template import Template, get_template
from twinkle.template.base import IGNORE_INDEX
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()
ENCODED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", "length")


@dataclass
class DatasetMeta:
    """What to load. ``data_slice`` picks rows by index; indices past the end wrap around, so
    ``range(1000)`` over a 150-row set repeats it in order."""

    dataset_id: str | None = None
    subset_name: str | None = None
    split: str = "train"
    data_slice: Sequence[int] | None = None


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class Dataset:
    """A list of rows that becomes a list of encoded samples. Methods return ``self``."""

    def __init__(self, dataset_meta: DatasetMeta):
        from twinkle.hub import resolve_dataset

        self.meta = dataset_meta
        data = resolve_dataset(
            dataset_meta.dataset_id, subset_name=dataset_meta.subset_name, split=dataset_meta.split
        )
        if dataset_meta.data_slice is not None:
            indices = [int(i) % len(data) for i in dataset_meta.data_slice]
            if not indices:
                raise UserError(
                    f"data_slice selects no rows of dataset {dataset_meta.dataset_id or 'self-cognition'}; "
                    "ask for at least one sample (e.g. --train-samples 1)"
                )
            if len(indices) > len(data):
                logger.info(
                    f"data_slice asks for {len(indices)} samples of a {len(data)}-row dataset: rows repeat"
                )
            data = data.select(indices)
        self.data: datasets.Dataset = data
        self.template: Template | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.data[index]

    def set_template(
        self,
        template_cls: str | type[Template] = "Template",
        model_id: str | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
    ) -> "Dataset":
        """Choose how rows become tokens (the tokenizer comes from ``model_id``)."""
        tokenizer = load_tokenizer(model_id)
        self.template = get_template(
            template_cls, tokenizer, max_length=max_length, truncation_strategy=truncation_strategy
        )
        return self

    def map(self, preprocessor: Callable[..., dict[str, Any]]) -> "Dataset":
        """Apply ``preprocessor(row, index)`` to every row (e.g. ``SelfCognitionProcessor``)."""
        self.data = self.data.map(
            preprocessor,
            with_indices=True,
            remove_columns=self.data.column_names,
            keep_in_memory=True,
            new_fingerprint=_fingerprint(
                self.data._fingerprint, type(preprocessor).__name__, vars(preprocessor)
            ),
            desc="preprocess",
        )
        return self

    def encode(self) -> "Dataset":
        """Tokenise every conversation into ``input_ids``, ``labels``, ``attention_mask``,
        ``position_ids`` and ``length``; rows dropped by ``truncation_strategy='delete'`` go."""
        template = self.template
        if template is None:
            raise UserError("call dataset.set_template(...) before dataset.encode()")
        if "messages" not in self.data.column_names:
            raise UserError("rows have no 'messages'; call dataset.map(<preprocessor>) before encode()")

        def encode_row(row: dict[str, Any], index: int) -> dict[str, Any]:
            out = template.encode(row["messages"], index=index)
            return out if out is not None else {k: [] if k != "length" else 0 for k in ENCODED_COLUMNS}

        encoded = self.data.map(
            encode_row,
            with_indices=True,
            remove_columns=self.data.column_names,
            keep_in_memory=True,
            new_fingerprint=_fingerprint(
                self.data._fingerprint,
                type(template).__name__,
                template.max_length,
                template.truncation_strategy,
                template.tokenizer.name_or_path,
            ),
            desc="encode",
        )
        before = len(encoded)
        # Dropped by 'delete', or truncated so that no reply token is left: such a sample
        # costs a forward and backward and teaches nothing.
        encoded = encoded.filter(
            lambda n, labels: n > 0 and any(t != IGNORE_INDEX for t in labels),
            input_columns=["length", "labels"],
            keep_in_memory=True,
        )
        if 0 < len(encoded) < before:
            logger.warning(
                f"{before - len(encoded)} of {before} samples dropped: no supervised token left after "
                f"--max-length {template.max_length} with --truncation-strategy {template.truncation_strategy}"
            )
        if len(encoded) == 0:
            raise UserError(
                f"no sample is left after encoding with --max-length {template.max_length} and "
                f"--truncation-strategy {template.truncation_strategy}; raise --max-length"
            )
        self.data = encoded
        return self

    @property
    def pad_token_id(self) -> int:
        if self.template is None:
            raise UserError("call dataset.set_template(...) first")
        return self.template.pad_token_id
