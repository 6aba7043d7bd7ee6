"""Padded tensor batches for tests that read a batch's tensors: a ``DataLoader`` with the
model's default processor (``InputProcessor``) on the loader. The model's steps take the rows
the plain loader yields as well, collated the same way (``tests/compat/test_data_loader_rows.py``)."""

from typing import Any

import torch

from twinkle.dataloader import DataLoader


def padded_batches(dataset: Any, batch_size: int, **kwargs: Any) -> DataLoader:
    loader = DataLoader(dataset, batch_size=batch_size, **kwargs)
    loader.set_processor("InputProcessor")
    return loader


def prefix_batch(lengths: tuple[int, ...] = (11, 5, 14), seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of a 6-token shared prefix and ``lengths`` more tokens; the answers after
    position 8 are supervised (``n - 3`` targets a row), and each row ends in a token after its
    last target (the MoE router's auxiliary loss counts it, the token loss does not)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 500, (6,), generator=g).tolist()
    rows = [prefix + torch.randint(1, 500, (n,), generator=g).tolist() for n in lengths]
    width = max(map(len, rows)) + 2
    batch = {
        k: torch.zeros(len(rows), width, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    batch["labels"] = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        n = len(row)
        batch["input_ids"][i, :n] = torch.tensor(row)
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
        batch["labels"][i, 8 : n - 1] = torch.tensor(row[8 : n - 1])
    return batch
