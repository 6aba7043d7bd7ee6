"""``CheckpointEngineManager.sync_weights``: after a training step the sampler computes the
trainer's log-probabilities (1e-4, fp32): colocated without copying anything, a separate copy
after a LoRA-only or a merged sync, and never before the sync that brings the step over."""

import pytest
import torch
from peft import LoraConfig

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model import MultiLoraTransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

PROMPTS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {"messages": [{"role": "user", "content": "Tell me about Paris France"}]},
]
PARAMS = SamplingParams(max_tokens=6, seed=11, num_samples=2)


def gaps(model, sampler, **kwargs) -> tuple[float, list[dict]]:
    """Sample; the largest gap between the sampler's log-probabilities and a plain forward of
    the trainer on the same sequences, and the sequences as training rows."""
    lm = causal_lm_of(model.model)
    worst, rows = 0.0, []
    for response in sampler.sample(PROMPTS, PARAMS, **kwargs):
        for seq in response.sequences:
            row = seq.new_input_feature
            ids = torch.tensor([row["input_ids"]])
            with torch.no_grad():
                logps = torch.log_softmax(lm(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            expected = logps[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)[-len(seq.tokens) :]
            mine = torch.tensor([entry[0][1] for entry in seq.logprobs])
            worst = max(worst, float((mine - expected).abs().max()))
            rows.append(row)
    return worst, rows


def train_step(model, rows: list[dict]) -> None:
    model.forward_backward(inputs=rows)
    assert model.clip_grad_and_step()


def base_weights(lm) -> dict[str, torch.Tensor]:
    """The base model's weights, by their names before any adapter was added."""
    return {
        n.replace(".base_layer", ""): p.detach().clone() for n, p in lm.named_parameters() if "lora_" not in n
    }


def test_colocated_sees_every_step_without_copying(make_model):
    model = make_model(init_lora_weights=False, lr=5e-2)
    sampler = TorchSampler(model)
    manager = CheckpointEngineManager(model, sampler)
    gap, rows = gaps(model, sampler)
    assert gap < 1e-4
    lm = causal_lm_of(model.model)
    ids = torch.tensor([rows[0]["input_ids"]])
    with torch.no_grad():
        before = lm(input_ids=ids).logits
    train_step(model, rows)
    with torch.no_grad():
        assert not torch.allclose(lm(input_ids=ids).logits, before, atol=1e-3)  # the step changed the model
    after, _ = gaps(model, sampler)  # no sync: the sampler runs the trainer's own modules
    assert after < 1e-4
    assert manager.sync_weights() == {"mode": "colocated", "tensors": 0, "bytes": 0}
    assert manager.sync_weights(merge_and_sync=True)["bytes"] == 0


def test_lora_sync_copies_the_adapter_only(make_model, tiny_model_dir):
    model = make_model(init_lora_weights=False, lr=5e-2)
    sampler = TorchSampler(str(tiny_model_dir))
    base_before = base_weights(sampler.lm)
    manager = CheckpointEngineManager(model, sampler)
    stale, rows = gaps(model, sampler)
    assert stale > 1e-3  # the base model alone: the trainer's adapter is not there yet
    report = manager.sync_weights()
    lora_bytes = sum(t.numel() * t.element_size() for t in model.get_state_dict().values())
    assert report == {"mode": "lora", "tensors": len(model.get_state_dict()), "bytes": lora_bytes}
    gap, rows = gaps(model, sampler)
    assert gap < 1e-4
    train_step(model, rows)
    stale, _ = gaps(model, sampler)
    assert stale > 1e-3  # the step is not there before the sync
    manager.sync_weights()
    gap, _ = gaps(model, sampler)
    assert gap < 1e-4
    after = base_weights(sampler.lm)
    assert all(torch.equal(after[n], base_before[n]) for n in base_before)  # the base was never written


def test_merged_sync_then_lora_sync(make_model, tiny_model_dir):
    model = make_model(init_lora_weights=False, lr=5e-2)
    sampler = TorchSampler(str(tiny_model_dir))
    manager = CheckpointEngineManager(model, sampler)
    base_before = base_weights(sampler.lm)
    report = manager.sync_weights(merge_and_sync=True)
    assert report["mode"] == "merged" and report["tensors"] == len(model.get_state_dict()) // 2
    assert sampler.default_adapter is None and not sampler.adapter_names  # merged: no adapter runs
    gap, rows = gaps(model, sampler)
    assert gap < 1e-4
    train_step(model, rows)
    manager.sync_weights(merge_and_sync=True)
    gap, _ = gaps(model, sampler)
    assert gap < 1e-4
    manager.sync_weights()  # back to LoRA-only: the plain base weights first
    gap, _ = gaps(model, sampler)
    assert gap < 1e-4
    after = base_weights(sampler.lm)
    assert all(torch.equal(after[n], base_before[n]) for n in base_before)


def test_multi_lora_adapter_syncs_by_name(tiny_model_dir):
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=8)
    for name, r in (("a", 4), ("b", 8)):
        model.add_adapter_to_model(name, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=5e-2, adapter_name=name)
    colocated = TorchSampler(model)
    _, rows = gaps(model, colocated, adapter_name="b")
    model.forward_backward(inputs=rows, adapter_name="b")
    model.clip_grad_and_step(adapter_name="b")
    sampler = TorchSampler(str(tiny_model_dir))
    manager = CheckpointEngineManager(model, sampler, adapter_name="b")
    manager.sync_weights()
    model.adapters.activate("b")  # the reference forward runs b's slot
    gap, _ = gaps(model, sampler)
    assert gap < 1e-4 and sampler.adapter_names == ["b"]


def test_manager_errors_are_one_line(make_model, tiny_model_dir):
    model, other = make_model(), make_model()
    cases = [
        (
            lambda: CheckpointEngineManager(model, TorchSampler(other)),
            r"runs the modules of another TransformersModel",
        ),
        (
            lambda: CheckpointEngineManager("model", TorchSampler(model)),
            r"takes a TransformersModel, got str",
        ),
        (
            lambda: CheckpointEngineManager(model, TorchSampler(str(tiny_model_dir))).sync_weights(
                adapter_name="x"
            ),
            r"unknown adapter 'x'",
        ),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
