"""Upstream's model calls as its DPO and GRPO scripts make them, on the tiny model: reference
log-probs from ``forward_only(disable_lora=True)``, ``forward_backward`` returning outputs with
``logps``, torch schedules and upstream's ``'default'`` optimizer and schedule, the per-call
accumulation window, ``attn_implementation`` on a CPU.

Tolerances: the same weights computing the same labels' log-probabilities along two code paths
(the step's hidden rows, the evaluation's) agree to float32 rounding of the tiny model (1e-5)."""

import math

import pytest
import torch
from peft import LoraConfig

from twinkle.loss import DPOLoss
from twinkle.metric import DPOMetric
from twinkle.model import TransformersModel, optimizer_step
from twinkle.model.inputs import prepare_inputs
from twinkle.utils.errors import UserError

ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Twinkle."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "A robot, sir."},
        ]
    },
    {"messages": [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "Twinkle"}]},
    {
        "messages": [
            {"role": "user", "content": "Your name?"},
            {"role": "assistant", "content": "Model Scope"},
        ]
    },
]


def _lrs(model, steps):
    """The learning rate each optimizer step runs at."""
    seen = []
    group = model.optimizer_group["default"]
    for _ in range(steps):
        seen.append(group.optimizer.param_groups[0]["lr"])
        model.forward_backward(inputs=ROWS[:2])
        assert model.clip_grad_and_step()
    return seen


def test_a_cosine_annealing_schedule_runs_at_torchs_own_rates(make_model):
    model = make_model(lr=1e-2)
    model.set_lr_scheduler("CosineAnnealingLR", T_max=4, eta_min=1e-3)  # no num_training_steps
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1e-2)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=1e-3)
    expected = []
    for _ in range(4):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert _lrs(model, 4) == pytest.approx(expected, rel=1e-12)
    assert expected[1] < expected[0]  # the schedule moved


def test_the_default_optimizer_and_schedule(make_model, monkeypatch):
    """'default' is AdamW with Megatron's keywords; its schedule warms up over lr_warmup_steps
    (the first step already above 0) and decays by a cosine over the rest of lr_decay_steps."""
    model = make_model()
    model.set_optimizer("default", lr=1e-3, weight_decay=0.05, adam_beta2=0.98, clip_grad=0.5)
    group = model.optimizer_group["default"]
    inner = group.optimizer.optimizer
    assert isinstance(inner, torch.optim.AdamW)
    assert inner.param_groups[0]["weight_decay"] == 0.05 and inner.param_groups[0]["betas"] == (0.9, 0.98)
    assert group.max_grad_norm == 0.5
    model.set_lr_scheduler("default", lr_decay_steps=4, lr_warmup_steps=1)
    cosine = [0.5 * (1 + math.cos(math.pi * r)) for r in (0, 1 / 3, 2 / 3)]
    assert _lrs(model, 4) == pytest.approx([1e-3] + [1e-3 * c for c in cosine], rel=1e-12)
    clipped_at = []
    real = optimizer_step.clip_gradients
    monkeypatch.setattr(
        optimizer_step, "clip_gradients", lambda p, norm, t: clipped_at.append(norm) or real(p, norm, t)
    )
    model.forward_backward(inputs=ROWS[:2])
    model.clip_grad_and_step()
    assert clipped_at == [0.5]  # the optimizer's clip_grad, not the run's --max-grad-norm
    with pytest.raises(UserError, match="no warm-up"):
        model.set_lr_scheduler("CosineAnnealingLR", num_warmup_steps=2, T_max=4)


def test_disable_lora_reference_logps_are_the_base_models(make_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = make_model(init_lora_weights=False)  # a random B: the adapter changes every output
    ref = model.forward_only(inputs=ROWS, disable_lora=True)["logps"]
    policy = model.forward_only(inputs=ROWS)["logps"]
    batch = prepare_inputs(model.optimizer_group["default"], ROWS, model.tokenizer)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    expected = torch.zeros(labels.shape)
    picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])
    expected[:, 1:] = picked[..., 0].masked_fill(labels[:, 1:] == -100, 0.0)
    assert torch.allclose(ref, expected, atol=1e-5), (ref - expected).abs().max()
    assert (policy - ref).abs().max() > 1e-3


def test_forward_backward_returns_upstreams_outputs(make_model):
    model = make_model(init_lora_weights=False)
    before = model.forward_only(inputs=ROWS)["logps"]
    out = model.forward_backward(inputs=ROWS)
    assert float(out) == out.get("loss") and out.get("num_tokens") > 0
    assert torch.allclose(out.get("logps"), before, atol=1e-5)
    out["logps"] = list(out.get("logps"))  # upstream's scripts replace entries
    assert len(out.get("logps")) == len(ROWS)
    parts = model.forward_backward(inputs=ROWS, micro_batch_size=1)
    assert torch.allclose(parts.get("logps"), before, atol=1e-5)
    assert torch.tensor([out, parts], dtype=torch.float64).tolist() == [float(out), float(parts)]  # numbers
    split = model.forward_only(inputs=ROWS, micro_batch_size=3)
    assert torch.allclose(split["logps"], before, atol=1e-5)
    with pytest.raises(UserError, match="ran in parts"):
        model.calculate_loss()


def test_dpo_as_upstreams_script_runs_it(make_model):
    model = make_model()  # B = 0: the policy is the base at step 0
    model.set_loss(DPOLoss(beta=0.1, loss_type="sigmoid", reference_free=False, sft_weight=0.0))
    model.add_metric(DPOMetric, beta=0.1)
    ref = model.forward_only(inputs=ROWS, disable_lora=True)
    out = model.forward_backward(inputs=ROWS, ref_outputs=ref)
    assert float(out) == pytest.approx(math.log(2), abs=1e-4)
    assert model.clip_grad_and_step()
    metrics = model.calculate_metric(is_training=True)
    assert metrics["pairs"] == 2 and "reward_margin" in metrics
    out = model.forward_backward(inputs=ROWS, ref_outputs=model.forward_only(inputs=ROWS, disable_lora=True))
    assert float(out) < math.log(2)  # the step moved the policy toward the chosen replies


def test_grpo_as_upstreams_script_runs_it(make_model):
    model = make_model(init_lora_weights=False)
    model.set_loss("GRPOLoss", epsilon=0.2)
    logps = model.forward_only(inputs=ROWS)["logps"]
    batch = prepare_inputs(model.optimizer_group["default"], ROWS, model.tokenizer)
    old = [row[labels != -100].tolist() for row, labels in zip(logps, batch["labels"], strict=True)]
    out = model.forward_backward(
        inputs=ROWS, old_logps=old, advantages=[1.0, -1.0, 0.5, -0.5], micro_batch_size=2
    )
    assert math.isfinite(float(out))
    assert torch.allclose(out.get("logps"), logps, atol=1e-5)  # the policy is still the sampler's
    assert model.clip_grad_and_step()


def test_the_accumulation_window_from_either_call(make_model):
    per_adapter = make_model(gradient_accumulation_steps=2)  # add_adapter_to_model(..., 2)
    per_call = make_model()
    for model, keywords in ((per_adapter, {}), (per_call, {"gradient_accumulation_steps": 2})):
        stepped = []
        for _ in range(4):
            model.forward_backward(inputs=ROWS[:2])
            stepped.append(model.clip_grad_and_step(**keywords))
        assert stepped == [False, True, False, True]
        assert model.optimizer_group["default"].optimizer_steps == 2


def test_flash_attention_on_a_cpu_runs_with_our_attention(tiny_model_dir):
    model = TransformersModel(
        model_id=str(tiny_model_dir),
        device_mesh=None,
        remote_group="policy",
        attn_implementation="flash_attention_2",
    )
    assert model.model.config._attn_implementation == "sdpa"
    model.add_adapter_to_model("default", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3)
    assert math.isfinite(float(model.forward_backward(inputs=ROWS[:2])))


def test_step_keywords_upstream_passes(make_model):
    model = make_model()
    model.forward_only(inputs=ROWS[:2], temperature=1.0, return_logits=False)  # neutral: accepted
    with pytest.raises(UserError, match="router_replay_action='R3': expected a RouterReplayAction"):
        model.forward_backward(inputs=ROWS[:2], router_replay_action="R3")
    with pytest.raises(UserError, match="temperature=0.7 is not supported yet"):
        model.forward_only(inputs=ROWS[:2], temperature=0.7)
