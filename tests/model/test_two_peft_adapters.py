"""A ``TransformersModel`` with two PEFT adapters runs, trains and counts the adapter each call
names. PEFT runs the last adapter added unless told otherwise: without ``set_adapter`` a call
for the first adapter would run (and its optimizer step) the second."""

import torch
from peft import LoraConfig

from twinkle.model import TransformersModel


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 200, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, :3] = -100
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
    }


def _model(folder, names: tuple[str, ...]) -> TransformersModel:
    model = TransformersModel(str(folder))
    for name in names:
        torch.manual_seed(0)  # "first" starts alike in every model; "second" is random, B too
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=name == "first")
        model.add_adapter_to_model(name, config)
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
    return model


def _logps(model, **kwargs) -> torch.Tensor:
    model.forward_only(_batch(), **kwargs)
    return model.last_outputs["logps"].clone()


def _train(model, name: str, steps: int = 2) -> None:
    for _ in range(steps):
        model.forward_backward(inputs=_batch(), adapter_name=name)
        model.clip_grad_and_step(adapter_name=name)


def test_each_call_runs_the_adapter_it_names(tiny_model_dir):
    """ "first" starts as the identity (LoRA B zero): its pass is the base model's exactly, though
    "second", added after it, would move every log-prob."""
    model = _model(tiny_model_dir, ("first", "second"))
    base = _logps(model, adapter_name="first", disable_lora=True)
    second = _logps(model, adapter_name="second")
    assert float((second - base).abs().max()) > 1e-2
    assert torch.equal(_logps(model, adapter_name="first"), base)
    assert torch.equal(_logps(model, adapter_name="second"), second)
    mixed = _logps(model, adapter_names=["first", "second", None])
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
    torch.testing.assert_close(mixed[1], second[1], rtol=1e-5, atol=1e-5)  # PEFT's per-row path


def test_training_one_adapter_moves_its_weights_only_as_if_alone(tiny_model_dir):
    """Training "first" beside "second" leaves "second" bit for bit and gives "first" the weights
    of a model holding "first" alone (the same operations on the same values)."""
    pair = _model(tiny_model_dir, ("first", "second"))
    second_before = {k: v.clone() for k, v in pair.get_state_dict("second").items()}
    _train(pair, "first")
    alone = _model(tiny_model_dir, ("first",))
    _train(alone, "first")
    trained, expected = pair.get_state_dict("first"), alone.get_state_dict("first")
    assert trained.keys() == expected.keys()
    assert any(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)  # it trained
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-5, atol=1e-6)
    after = pair.get_state_dict("second")
    assert all(torch.equal(after[k], second_before[k]) for k in second_before)
    first_before = {k: v.clone() for k, v in trained.items()}
    _train(pair, "second", steps=1)
    assert all(torch.equal(pair.get_state_dict("first")[k], first_before[k]) for k in first_before)
    assert any(not torch.equal(pair.get_state_dict("second")[k], second_before[k]) for k in second_before)
