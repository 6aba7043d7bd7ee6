"""Padding-free batches give the loss and gradients of the padded batch."""

import torch
from transformers import LlamaConfig

from twinkle.dataloader import DataLoader
from twinkle.model.packing import choose_packing, pack


def _loss_and_grads(make_model, batch, padding_free: bool):
    model = make_model(init_lora_weights=False)
    model.padding_free = padding_free
    loss = model.forward_backward(inputs=batch)
    grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    return loss, grads


def test_packed_equals_padded(make_model, dataset):
    batch = next(iter(DataLoader(dataset, batch_size=4)))
    lengths = batch["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch really has padding
    loss_padded, grads_padded = _loss_and_grads(make_model, batch, padding_free=False)
    loss_packed, grads_packed = _loss_and_grads(make_model, batch, padding_free=True)
    # fp32, different matmul shapes: only summation order differs.
    assert abs(loss_padded - loss_packed) < 1e-5
    assert grads_padded.keys() == grads_packed.keys() and grads_padded
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_pack_layout():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        "labels": torch.tensor([[5, 6, 7], [8, 9, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "position_ids": torch.tensor([[0, 1, 2], [0, 1, 0]]),
    }
    packed = pack(batch)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # each sample's first token is no target: the shift never crosses a sample border
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert packed["attention_mask"] is None


def test_packing_is_chosen_only_when_cheaper():
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3
    )
    assert choose_packing(config, torch.tensor([57, 40, 45, 50]))  # short rows: padding dominates
    assert not choose_packing(
        config, torch.tensor([1024, 1000, 700, 600])
    )  # long rows: T^2 attention dominates
    assert not choose_packing(config, torch.tensor([64]))  # nothing to pack
    config.model_type = "gemma2"
    assert not choose_packing(config, torch.tensor([57, 40]))  # unknown masking: never pack
