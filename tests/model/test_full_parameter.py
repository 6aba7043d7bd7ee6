"""Full-parameter training: a ``TransformersModel`` given no adapter trains every weight
(``twinkle.model.full_parameter``), as upstream's ``dpo_full.py`` drives it.

Tolerances. One step against a plain torch step on the same batch: the same terms summed in other
orders (packed vs padded rows, our loss vs ``F.cross_entropy``), so the loss and every gradient
are within the first-order bound of the tiny model's chain of sums over the batch
(``chain_tolerances`` of ``tiny_batch_sums``, plus the normalisation's rounding), and the weights
after one AdamW step within ``adamw_weight_atol`` (a gradient within its rounding of zero may step
the other way). A saved checkpoint holds the weights bit for bit, so ``from_pretrained`` gives
the same logits up to the two forwards' orders (the same chain bound). A resumed run repeats the
uninterrupted run's arithmetic in the same process: exactly equal."""

import math

import pytest
import torch
import torch.nn.functional as F
from batches import padded_batches
from peft import LoraConfig
from tolerances import adamw_weight_atol, chain_tolerances, probable_gamma, tiny_batch_sums
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.dataloader import collate
from twinkle.metric import DPOMetric
from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.model.full_parameter import FULL
from twinkle.template import get_template
from twinkle.template.base import IGNORE_INDEX
from twinkle.utils.errors import UserError

LR = 1e-3
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def plain_torch_step(model_dir, batch) -> tuple[float, dict, dict, float]:
    """The reference: Hugging Face's model, the mean token cross entropy of the batch, torch's
    clipping at 1.0 and AdamW (its default weight decay on the matrices only). Returns (loss, token-sum gradients, weights after, grad norm)."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = ref(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    tokens = int((labels != IGNORE_INDEX).sum())
    grads = {n: p.grad.detach() * tokens for n, p in ref.named_parameters()}  # the model's token sums
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    matrices = [p for p in ref.parameters() if p.dim() >= 2]
    vectors = [p for p in ref.parameters() if p.dim() < 2]  # biases and norm scales: no decay
    torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=LR).step()
    return float(loss.detach()), grads, {n: p.detach() for n, p in ref.named_parameters()}, norm


def test_one_sft_step_trains_every_weight_as_a_plain_torch_step(tiny_model_dir, dataset):
    model = TransformersModel(str(tiny_model_dir))
    model.set_optimizer("AdamW", lr=LR)
    assert list(model.optimizer_group) == [FULL]
    assert "full_parameter=True" in model.get_train_configs()
    groups = model.optimizer_group[FULL].optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [len(g["params"]) for g in groups] == [
        sum(p.dim() >= 2 for p in model.model.parameters()),
        sum(p.dim() < 2 for p in model.model.parameters()),
    ]
    batch = next(iter(padded_batches(dataset, batch_size=4)))
    before = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    assert all(p.requires_grad for p in model.model.parameters())
    loss = float(model.forward_backward(inputs=batch))
    grads = {n: p.grad.detach().clone() for n, p in model.model.named_parameters()}
    assert model.clip_grad_and_step()
    norm = model.calculate_metric(is_training=True)["grad_norm"]

    ref_loss, ref_grads, ref_weights, ref_norm = plain_torch_step(tiny_model_dir, batch)
    sums = tiny_batch_sums(batch["input_ids"]) + [2]
    expected = torch.tensor(ref_loss, dtype=torch.float64)
    torch.testing.assert_close(
        torch.tensor(loss, dtype=torch.float64), expected, **chain_tolerances(sums, expected)
    )
    torch.testing.assert_close(
        torch.tensor(norm, dtype=torch.float64),
        torch.tensor(ref_norm, dtype=torch.float64),
        **chain_tolerances(sums, torch.tensor(ref_norm)),
    )
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert grad.abs().sum() > 0, name  # a zero gradient would prove nothing
        torch.testing.assert_close(
            grads[name], grad, **chain_tolerances(sums, grad), msg=lambda m, n=name: f"{n}: {m}"
        )
    atol = adamw_weight_atol(LR, 1)
    for name, p in model.model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not train"
        torch.testing.assert_close(
            p.detach(), ref_weights[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def _train(model, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(float(model.forward_backward(inputs=batch)))
        model.clip_grad_and_step(gradient_accumulation_steps=2)
    return losses


def _fresh(model_dir, horizon: int) -> TransformersModel:
    model = TransformersModel(str(model_dir))
    model.set_optimizer("AdamW", lr=LR)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=horizon)
    model.set_loss("CrossEntropyLoss")
    return model


def test_save_is_a_hugging_face_model_and_resume_continues_identically(tiny_model_dir, dataset, tmp_path):
    batches = list(padded_batches(dataset, batch_size=4))  # 5 micro-batches, windows of 2
    torch.manual_seed(0)
    whole = _fresh(tiny_model_dir, len(batches))
    first = _train(whole, batches[:3])  # a step, then a window left open with one micro-batch
    path = whole.save("checkpoint-3", output_dir=str(tmp_path))
    rest = _train(whole, batches[3:])

    names = {f.name for f in path.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state.json", "optimizer.pt"} <= names
    assert "adapter_model.safetensors" not in names and "adapter_config.json" not in names
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(path).vocab_size == whole.tokenizer.vocab_size

    resumed = _fresh(tiny_model_dir, len(batches))
    state = resumed.resume_from_checkpoint(str(path))
    assert state["cur_step"] == 3
    saved = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    state = resumed.get_state_dict()  # every weight under the model's own names
    assert all(torch.equal(state[n], p) for n, p in saved.items())
    for name, p in loaded.named_parameters():  # the file holds the weights of the step bit for bit
        assert torch.equal(p, saved[name]), name
    batch = batches[0]
    with torch.no_grad():
        loaded.eval()
        resumed.model.eval()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        ours, theirs = resumed.model(**inputs).logits, loaded(**inputs).logits
    sums = tiny_batch_sums(batch["input_ids"])
    torch.testing.assert_close(ours, theirs, **chain_tolerances(sums, theirs))

    assert _train(resumed, batches[3:]) == rest  # the open window's gradients, optimizer and schedule
    assert resumed.optimizer_group[FULL].optimizer_steps == whole.optimizer_group[FULL].optimizer_steps == 3
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert len(first) == 3


def test_lora_and_full_parameter_training_do_not_mix(tiny_model_dir):
    full = TransformersModel(str(tiny_model_dir))
    full.set_loss("CrossEntropyLoss")  # the first call without an adapter: every weight trains
    with pytest.raises(UserError, match="already trains every weight") as info:
        full.add_adapter_to_model("default", LORA)
    assert "\n" not in str(info.value)

    lora = TransformersModel(str(tiny_model_dir))
    lora.add_adapter_to_model("default", LORA)
    with pytest.raises(UserError, match="cannot also train every weight") as info:
        lora.set_optimizer("AdamW", lr=LR, adapter_name=FULL)
    assert "\n" not in str(info.value)
    lora.set_optimizer("AdamW", lr=LR)  # without a name: its one adapter, as before
    assert list(lora.optimizer_group) == ["default"]

    slots = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=1, max_r=4)  # adapters only
    with pytest.raises(UserError, match="MultiLoraTransformersModel has no adapter"):
        slots.set_optimizer("AdamW", lr=LR)


PAIRS = [
    ("Who are you?", "I am Twinkle, made by Acme.", "I am a robot from Paris France."),
    ("What is your name?", "Twinkle", "ModelScope"),
]
BETA = 0.1


def test_full_parameter_dpo_steps_against_a_frozen_reference_model(tiny_model_dir):
    """dpo_full.py's shape: the reference is a second model without an adapter whose
    ``forward_only`` gives the log-probabilities; the policy trains every weight."""
    policy, reference = TransformersModel(str(tiny_model_dir)), TransformersModel(str(tiny_model_dir))
    policy.set_optimizer("AdamW", lr=1e-2)
    policy.set_loss("DPOLoss", beta=BETA)
    policy.add_metric(DPOMetric, beta=BETA)
    reference.set_processor("InputProcessor")
    template = get_template("Template", policy.tokenizer)
    rows = [
        template.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        for q, chosen, rejected in PAIRS
        for a in (chosen, rejected)
    ]
    batch = collate(rows, policy.tokenizer.pad_token_id)
    frozen = {n: p.detach().clone() for n, p in reference.model.named_parameters()}

    with pytest.raises(UserError, match="no LoRA adapter to turn off") as info:
        policy.forward_only(inputs=batch, disable_lora=True)  # it would be the policy, not a reference
    assert "\n" not in str(info.value)
    ref = reference.forward_only(inputs=batch)
    loss = float(policy.forward_backward(inputs=batch, ref_outputs=ref))
    # Policy and reference are the same weights: each pair's reward margin is rounding only, each
    # log-probability within twice the probabilistic bound of the chain times its magnitude, and
    # the sigmoid loss's slope at 0 is 1/2.
    bound = 2 * probable_gamma(sum(tiny_batch_sums(batch["input_ids"])))
    margin = BETA * bound * float(ref["logps"].abs().sum()) / len(PAIRS)
    assert abs(loss - math.log(2)) <= 0.5 * margin + 1e-7, (loss, margin)
    assert policy.clip_grad_and_step()
    first = policy.calculate_metric(is_training=True)
    for _ in range(2):
        ref = reference.forward_only(inputs=batch)
        policy.forward_backward(inputs=batch, ref_outputs=ref)
        policy.clip_grad_and_step()
    last = policy.calculate_metric(is_training=True)
    assert last["loss"] < first["loss"] and last["reward_margin"] > 0, (first, last)
    for name, p in reference.model.named_parameters():  # the reference never steps
        assert torch.equal(p, frozen[name]), name
