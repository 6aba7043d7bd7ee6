"""Padded tensor batches for tests that read a batch's tensors: a ``DataLoader`` with the
model's default processor (``InputProcessor``) on the loader. The model's steps take the rows
the plain loader yields as well, collated the same way (``tests/compat/test_data_loader_rows.py``)."""

from typing import Any

from twinkle.dataloader import DataLoader


def padded_batches(dataset: Any, batch_size: int, **kwargs: Any) -> DataLoader:
    loader = DataLoader(dataset, batch_size=batch_size, **kwargs)
    loader.set_processor("InputProcessor")
    return loader
