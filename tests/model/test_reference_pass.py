"""The DPO reference pass, ``forward_only(inputs=batch, disable_lora=True)``: a no-grad forward of
the base layers with the head on the supervised positions only (no full-vocabulary logits), on
``TransformersModel`` and on ``MultiLoraTransformersModel``, whose ``forward``/``forward_only``
take ``ref_outputs=`` like the single-adapter model.

Tolerance: at step 0 (B = 0) the policy and the reference are one function computed by possibly
different kernels, so a pair's ``d`` is rounding only: each token's log-probability within twice
Higham and Mary's probabilistic bound of the tiny model's chain (``probable_gamma`` of
``tiny_batch_sums``) times its magnitude, summed over the pair's tokens; the sigmoid loss is then
ln 2 within its slope at 0 (beta / 4) times that. A random B moves ``d`` by far more."""

import math

import torch
from peft import LoraConfig
from tolerances import probable_gamma, tiny_batch_sums

from twinkle.dataloader import collate
from twinkle.loss import DPOLoss
from twinkle.metric import DPOMetric
from twinkle.model import MultiLoraTransformersModel
from twinkle.model.forward import causal_lm_of
from twinkle.template import get_template

PAIRS = [
    ("Who are you?", "I am Twinkle, made by Acme.", "I am a robot from Paris France."),
    ("What is your name?", "Twinkle", "ModelScope"),
]


def pair_batch(tokenizer) -> dict[str, torch.Tensor]:
    template = get_template("Template", tokenizer)
    rows = []
    for question, chosen, rejected in PAIRS:
        for answer in (chosen, rejected):
            rows.append(
                template.encode(
                    [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                )
            )
    return collate(rows, tokenizer.pad_token_id)


def test_the_reference_pass_never_builds_full_logits(make_model):
    """The model's forward hands back hidden states (its head runs as the identity), never
    vocabulary-wide logits, and no gradient graph is kept. (The hook sits on the causal LM, not on
    the head: a hooked head is no plain linear layer and would run as the model's own.)"""
    model = make_model()
    model.set_loss(DPOLoss(beta=0.1))
    batch = pair_batch(model.tokenizer)
    lm = causal_lm_of(model.model)
    widths = []
    hook = lm.register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[-1]))
    try:
        ref = model.forward_only(inputs=batch, disable_lora=True)
    finally:
        hook.remove()
    hidden, vocab = lm.config.hidden_size, lm.get_output_embeddings().out_features
    assert widths == [hidden] and hidden != vocab, (widths, hidden, vocab)
    logps = ref["logps"]
    assert logps.shape == batch["labels"].shape and not logps.requires_grad
    assert torch.all(logps[batch["labels"] == -100] == 0) and bool((logps < 0).any())


def test_dpo_runs_on_multi_lora(tiny_model_dir):
    """One DPO step and a DPO evaluation through ``MultiLoraTransformersModel``: ln 2 at step 0
    (module docstring), below it on the same pairs after the step; the metric sees the reference."""
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=4)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model.add_adapter_to_model("a", config)
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="a")
    model.set_loss(DPOLoss(beta=0.1), adapter_name="a")
    model.add_metric(DPOMetric, adapter_name="a", beta=0.1)
    batch = pair_batch(model.tokenizer)
    ref = model.forward_only(inputs=batch, adapter_name="a", disable_lora=True)
    loss = model.forward_backward(inputs=batch, adapter_name="a", ref_outputs=ref)
    per_token = 2 * probable_gamma(sum(tiny_batch_sums(batch["input_ids"]))) * float(ref["logps"].abs().max())
    tokens = (batch["labels"] != -100).sum(1)
    bound = 0.1 / 4 * per_token * float((tokens[0::2] + tokens[1::2]).max())
    assert abs(loss - math.log(2)) <= bound, (loss, bound)
    model.clip_grad_and_step(adapter_name="a")
    after = model.forward_only(inputs=batch, adapter_name="a", ref_outputs=ref)
    assert after["num_tokens"] == 2 and after["loss"] < math.log(2) - 100 * bound, (after, bound)
    model.calculate_loss()
    metrics = model.calculate_metric(is_training=False, adapter_name="a")
    assert metrics["pairs"] == 2 and "reward_margin" in metrics


class _Clock:
    """A ``time`` stand-in whose ``perf_counter`` reads ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_a_training_steps_reference_pass_leaves_the_next_evaluations_clock_alone(make_model, monkeypatch):
    """Eval tokens/s counts the evaluation's own time: the reference passes of the training steps
    before it (``forward_only`` too) must not start its clock."""
    from twinkle.metric import token_metrics

    clock = _Clock()
    monkeypatch.setattr(token_metrics, "time", clock)
    model = make_model()
    model.set_loss(DPOLoss(beta=0.1))
    batch = pair_batch(model.tokenizer)
    for _ in range(2):  # training steps, 100 s apart
        ref = model.forward_only(inputs=batch, disable_lora=True)
        model.forward_backward(inputs=batch, ref_outputs=ref)
        model.clip_grad_and_step()
        clock.now += 100.0
    ref = model.forward_only(inputs=batch, disable_lora=True)  # the evaluation: 2 s
    clock.now += 1.0
    model.forward_only(inputs=batch, ref_outputs=ref)
    model.calculate_loss()
    clock.now += 1.0
    metrics = model.calculate_metric(is_training=False)
    assert metrics["tokens"] == int(batch["attention_mask"].sum())
    assert metrics["tokens_per_second"] == metrics["tokens"] / 2.0, metrics


def test_a_training_window_counts_its_steps_reference_passes(make_model, monkeypatch):
    """Train tokens/s runs from the first step's reference pass: a DPO step is both passes."""
    from twinkle.metric import token_metrics

    clock = _Clock()
    monkeypatch.setattr(token_metrics, "time", clock)
    model = make_model()
    model.set_loss(DPOLoss(beta=0.1))
    batch = pair_batch(model.tokenizer)
    ref = model.forward_only(inputs=batch, disable_lora=True)
    clock.now += 1.0  # the reference pass
    model.forward_backward(inputs=batch, ref_outputs=ref)
    model.clip_grad_and_step()
    clock.now += 2.0  # the policy's forward, backward and step
    metrics = model.calculate_metric(is_training=True)
    assert metrics["tokens_per_second"] == metrics["tokens"] / 3.0, metrics
    # an evaluation between two windows starts neither: the next window is its step's alone
    ref = model.forward_only(inputs=batch, disable_lora=True)
    model.forward_only(inputs=batch, ref_outputs=ref)
    model.calculate_loss()
    model.calculate_metric(is_training=False)
    clock.now += 50.0
    ref = model.forward_only(inputs=batch, disable_lora=True)
    model.forward_backward(inputs=batch, ref_outputs=ref)
    clock.now += 4.0
    assert model.calculate_metric(is_training=True)["tokens_per_second"] == metrics["tokens"] / 4.0
