"""Upstream's loader shape: the ``DataLoader`` yields a rank's rows and the model's processor
collates them. Our own small scripts, written as an upstream user writes them."""

import pytest
import torch

from twinkle.dataloader import DataLoader
from twinkle.processor import InputProcessor
from twinkle.utils.errors import UserError


def test_the_contract_loop_on_rows_steps_as_on_the_padded_batch(make_model, dataset):
    """``for batch in dataloader: model.forward_backward(inputs=batch)``: rows give the very
    loss and weights the padded batch gives (the model collates them the same way)."""
    rows_model, tensor_model = make_model(init_lora_weights=False), make_model(init_lora_weights=False)
    padded = InputProcessor(pad_token_id=dataset.pad_token_id)
    for batch in list(DataLoader(dataset=dataset, batch_size=4))[:2]:
        assert isinstance(batch, list) and all("input_ids" in row for row in batch)
        assert rows_model.forward_backward(inputs=batch) == tensor_model.forward_backward(
            inputs=padded(batch)
        )
        rows_model.clip_grad_and_step()
        tensor_model.clip_grad_and_step()
    for a, b in zip(rows_model.model.parameters(), tensor_model.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_left_padding_on_the_model_gives_the_right_padded_loss(make_model, dataset):
    rows = next(iter(DataLoader(dataset=dataset, batch_size=4)))
    model = make_model(init_lora_weights=False)
    right = model.forward_only(inputs=rows)["loss"]
    model.set_processor("InputProcessor", padding_side="left")
    processor = model.optimizer_group["default"].processor
    assert processor.padding_side == "left" and processor.pad_token_id == dataset.pad_token_id
    left = model.forward_only(inputs=rows)
    assert left["loss"] == pytest.approx(right, rel=1e-4)
    assert left["logps"].shape[0] == len(rows)


def test_set_processor_by_class_with_padding_free(make_model, dataset):
    model = make_model()
    model.set_processor(InputProcessor, padding_free=True)
    assert model.optimizer_group["default"].processor.padding_free
    rows = next(iter(DataLoader(dataset=dataset, batch_size=2)))
    assert model.forward_backward(inputs=rows) > 0


def test_a_processor_on_the_loader_makes_the_batch(dataset):
    loader = DataLoader(dataset=dataset, batch_size=4)
    loader.set_processor("InputProcessor")
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert batch["input_ids"].shape[0] == 4 and bool(
        (batch["input_ids"][batch["attention_mask"] == 0] == dataset.pad_token_id).all()
    )
    firsts = DataLoader(
        dataset=dataset, batch_size=4, collate_fn=lambda rows: [r["input_ids"][0] for r in rows]
    )
    assert next(iter(firsts)) == [dataset[i]["input_ids"][0] for i in range(4)]


def test_workers_read_the_same_rows(dataset):
    alone = list(DataLoader(dataset=dataset, batch_size=4))
    assert list(DataLoader(dataset=dataset, batch_size=4, num_workers=2)) == alone


def test_an_empty_share_is_an_empty_list_the_model_steps_on(make_model, dataset):
    shares = list(DataLoader(dataset=dataset, batch_size=2, world_size=2, rank=1))
    short = list(DataLoader(dataset=[dataset[i] for i in range(3)], batch_size=2, world_size=2, rank=1))
    assert len(shares) == len(dataset) // 2 and short[-1] == []
    assert make_model().forward_backward(inputs=[]) == 0.0  # a rank with no row still steps


def test_bad_processor_names_are_one_line(make_model):
    loader = DataLoader(dataset=[{"a": 1}], batch_size=1, world_size=1, rank=0)
    for call in (lambda: loader.set_processor("Collator"), lambda: make_model().set_processor("Collator")):
        with pytest.raises(
            UserError, match="unknown processor 'Collator'; valid names: InputProcessor"
        ) as caught:
            call()
        assert "\n" not in str(caught.value)
