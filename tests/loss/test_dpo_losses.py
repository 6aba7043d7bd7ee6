"""The preference losses (``twinkle.loss.dpo``, ``twinkle.loss.preference``), ``DPOMetric`` and the
model's side of a DPO step: ``ref = model.forward_only(inputs=batch, disable_lora=True)``, then
``model.forward_backward(inputs=batch, ref_outputs=ref)``.

Batches are built here from the tiny model's template: rows interleaved [chosen_1, rejected_1,
chosen_2, rejected_2], each pair sharing its prompt.

Tolerances: the formulas are checked in float64 against math-module arithmetic on the same
numbers (1e-9: a few roundings of values below 100). At step 0 the policy (LoRA B = 0) and the
reference (adapters off) are the same function computed by possibly different kernels (fused
LoRA node vs PEFT's base layer, the head on the supervised rows vs on every row): each token's
log-probability within twice Higham and Mary's probabilistic bound of the tiny model's chain of
sums (``tolerances.probable_gamma`` of ``tiny_batch_sums``; the worst-case ``gamma`` would not tell
a B of 0 from a small random one) times its magnitude, so a pair's ``d`` within the sum of that
over its tokens, and a loss within its slope at ``d = 0`` times that."""

import json
import math

import pytest
import torch
from tolerances import gamma, probable_gamma, tiny_batch_sums

import twinkle
from twinkle.dataloader import collate
from twinkle.loss import CPOLoss, DPOLoss, ORPOLoss, SimPOLoss, build_loss
from twinkle.metric import DPOMetric, report
from twinkle.runtime import RunDefaults
from twinkle.template import get_template
from twinkle.utils.errors import UserError

IGNORE = -100
PAIRS = [
    ("Who are you?", "I am Twinkle, made by Acme.", "I am a robot from Paris France."),
    ("What is your name?", "Twinkle", "ModelScope"),
]


def pair_batch(tokenizer, pairs=PAIRS) -> dict[str, torch.Tensor]:
    template = get_template("Template", tokenizer)
    rows = []
    for question, chosen, rejected in pairs:
        for answer in (chosen, rejected):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append(template.encode(messages))
    return collate(rows, tokenizer.pad_token_id)


def dpo_model(make_model, **loss_kwargs):
    model = make_model()
    model.set_loss("DPOLoss", **loss_kwargs)
    return model


def step0_d_bound(batch: dict[str, torch.Tensor], ref_logps: torch.Tensor) -> float:
    """The largest ``|d|`` of a pair that rounding alone allows at step 0 (module docstring)."""
    per_token = (
        2 * probable_gamma(int(sum(tiny_batch_sums(batch["input_ids"])))) * float(ref_logps.abs().max())
    )
    tokens = (batch["labels"] != IGNORE).sum(1)
    return per_token * float((tokens[0::2] + tokens[1::2]).max())


@pytest.mark.parametrize(
    ("loss_type", "expected", "slope"),
    [("sigmoid", math.log(2), 0.05), ("hinge", 1.0, 0.1), ("ipo", 25.0, 10.0)],
)
def test_at_the_reference_the_losses_take_their_known_values(make_model, loss_type, expected, slope):
    """beta 0.1: ln 2, 1 and (1 / (2 beta))^2; ``slope`` is |dL/dd| at d = 0."""
    model = dpo_model(make_model, beta=0.1, loss_type=loss_type)
    batch = pair_batch(model.tokenizer)
    ref = model.forward_only(inputs=batch, disable_lora=True)
    assert math.isnan(ref["loss"]) and ref["logps"].shape == batch["labels"].shape
    loss = model.forward_backward(inputs=batch, ref_outputs=ref)
    bound = step0_d_bound(batch, ref["logps"])
    assert abs(loss - expected) <= slope * bound + 1e-6 * expected, (loss, expected, bound)
    trained = [p.grad for n, p in model.model.named_parameters() if "lora_B" in n]
    assert trained and all(g is not None for g in trained)  # the policy's adapters get gradients
    assert any(float(g.abs().sum()) > 0 for g in trained)


def random_rows(seed: int, rows: int = 6, length: int = 9):
    """Random fp64 log-probs (B, L) and labels with 1 to L-1 supervised positions per row."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    labels = torch.full((rows, length), IGNORE)
    for r in range(rows):
        start = int(torch.randint(0, length - 1, (1,), generator=g))
        labels[r, start:] = 7
    return logps, ref, labels


def by_hand(loss, logps, ref, labels) -> float:
    """The loss's published formula per pair, in Python floats, averaged over the pairs."""
    sums, refs, lens = [], [], []
    for r in range(labels.shape[0]):
        mask = [j for j in range(labels.shape[1]) if int(labels[r, j]) != IGNORE]
        sums.append(sum(float(logps[r, j]) for j in mask))
        refs.append(sum(float(ref[r, j]) for j in mask))
        lens.append(len(mask))

    def logsig(x):
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))

    out = []
    for i in range(0, len(sums), 2):
        pc, pr, lc, lr = sums[i], sums[i + 1], lens[i], lens[i + 1]
        if isinstance(loss, DPOLoss):
            d = pc - pr if loss.reference_free else (pc - refs[i]) - (pr - refs[i + 1])
            b, e = loss.beta, loss.label_smoothing
            value = {
                "sigmoid": -(1 - e) * logsig(b * d) - e * logsig(-b * d),
                "hinge": max(0.0, 1 - b * d),
                "ipo": (d - 1 / (2 * b)) ** 2,
            }[loss.loss_type] + loss.sft_weight * (-pc / lc)
        elif isinstance(loss, SimPOLoss):
            value = -logsig(loss.beta * (pc / lc - pr / lr) - loss.gamma)
        elif isinstance(loss, CPOLoss):
            value = -logsig(loss.beta * (pc - pr)) + loss.bc_coef * (-pc / lc)
        else:
            ac, ar = pc / lc, pr / lr
            odds = (ac - math.log(1 - math.exp(ac))) - (ar - math.log(1 - math.exp(ar)))
            value = -pc / lc - loss.lambda_orpo * logsig(odds)
        out.append(value)
    return sum(out) / len(out)


LOSSES = [
    DPOLoss(beta=0.1),
    DPOLoss(beta=0.5, loss_type="hinge"),
    DPOLoss(beta=0.2, loss_type="ipo"),
    DPOLoss(beta=0.1, label_smoothing=0.2),
    DPOLoss(beta=0.3, sft_weight=0.5),
    DPOLoss(beta=0.1, reference_free=True),
    SimPOLoss(beta=2.0, gamma=0.4),
    CPOLoss(beta=0.2, bc_coef=0.7),
    ORPOLoss(lambda_orpo=0.3),
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: f"{loss.name}-{sorted(vars(loss).items())}")
@pytest.mark.parametrize("seed", [0, 1])
def test_every_loss_matches_its_formula_by_hand(loss, seed):
    logps, ref, labels = random_rows(seed)
    inputs = {"labels": labels, "ref_logps": ref}
    out = loss(inputs, {"logps": logps})
    assert out["num_tokens"] == labels.shape[0] // 2  # a sum over the pairs
    value = float(out["loss"]) / out["num_tokens"]
    assert abs(value - by_hand(loss, logps, ref, labels)) <= 1e-9


def test_gradients_reach_the_policy_only():
    """d(sum of pair losses)/d(token logp) is -beta sigmoid(-beta d) on the chosen row's tokens
    and the opposite on the rejected row's; the reference gets none."""
    logps, ref, labels = random_rows(2)
    mask = labels != IGNORE
    policy = logps[mask].clone().requires_grad_(True)
    reference = ref[mask].clone().requires_grad_(True)
    samples = mask.nonzero(as_tuple=True)[0]
    loss = DPOLoss(beta=0.3)
    out = loss.from_rows(policy, samples, labels.shape[0], reference)
    out.loss_sum.backward()
    assert reference.grad is None
    sums = torch.zeros(labels.shape[0], dtype=torch.float64).index_add(0, samples, logps[mask])
    ref_sums = torch.zeros(labels.shape[0], dtype=torch.float64).index_add(0, samples, ref[mask])
    d = (sums[0::2] - ref_sums[0::2]) - (sums[1::2] - ref_sums[1::2])
    per_pair = -0.3 * torch.sigmoid(-0.3 * d)
    sign = torch.where(samples % 2 == 0, 1.0, -1.0).double()
    torch.testing.assert_close(policy.grad, sign * per_pair[samples // 2], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DPOLoss(beta=0), r"DPOLoss: beta must be above 0, got 0; pass a positive beta"),
        (lambda: DPOLoss(beta=-0.1), r"DPOLoss: beta must be above 0, got -0.1"),
        (lambda: build_loss("DPOLoss", beta=0.0), r"beta must be above 0"),
        (lambda: SimPOLoss(beta=0), r"SimPOLoss: beta must be above 0"),
        (lambda: DPOLoss(loss_type="kto"), r"unknown loss_type 'kto'; valid types: sigmoid, hinge, ipo"),
        (
            lambda: DPOLoss(loss_type="hinge", label_smoothing=0.1),
            r"label_smoothing=0.1 needs loss_type='sigmoid'",
        ),
        (lambda: DPOLoss(sft_weight=-1), r"sft_weight must be 0 or more"),
    ],
)
def test_bad_settings_are_one_line_errors(build, message):
    with pytest.raises(UserError, match=message) as err:
        build()
    assert "\n" not in str(err.value)


def test_bad_batches_are_one_line_errors(make_model):
    model = dpo_model(make_model, beta=0.1)
    batch = pair_batch(model.tokenizer)
    ref = model.forward_only(inputs=batch, disable_lora=True)
    odd = {k: v[:3] for k, v in batch.items()}
    one_side = dict(batch, labels=batch["labels"].clone())
    one_side["labels"][3] = IGNORE
    cases = [
        (
            lambda: model.forward_backward(inputs=odd, ref_outputs={"logps": ref["logps"][:3]}),
            r"DPOLoss needs rows in pairs \[chosen_1, rejected_1, chosen_2, ...\], but the batch has 3 rows",
        ),
        (
            lambda: model.forward_backward(inputs=batch),
            r"the loss DPOLoss needs the batch tensor\(s\) \['ref_logps'\]; .* ref_outputs=model.forward_only",
        ),
        (
            lambda: model.forward_backward(inputs=batch, ref_outputs={"logps": ref["logps"][:, :-1]}),
            r"ref_logps has shape \(4, \d+\), but the batch is 4 x \d+; pass one value per label",
        ),
        (
            lambda: model.forward_backward(inputs=batch, ref_outputs={"loss": 1.0}),
            r"ref_outputs= got dict without 'logps'; pass what model.forward_only\(...\) returned",
        ),
        (
            lambda: model.forward_backward(inputs=batch, ref_outputs=ref, advantages=torch.zeros(4)),
            r"advantages= is not an input of the loss DPOLoss \(it reads ref_logps\)",
        ),
        (
            lambda: model.forward_backward(inputs=one_side, ref_outputs=ref),
            r"row 3 \(the rejected side of pair 1\) has no supervised token",
        ),
        (
            lambda: model.calculate_loss(),
            r"the last forward_only had no ref_logps for the loss DPOLoss, so there is no loss to record",
        ),
    ]
    for call, message in cases:
        with pytest.raises(UserError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    model.set_loss("CrossEntropyLoss")
    with pytest.raises(UserError, match=r"ref_outputs= \(its ref_logps\) is not an input of the loss Cross"):
        model.forward_backward(inputs=batch, ref_outputs=ref)


def direct_label_logps(model, batch) -> tuple[torch.Tensor, float]:
    """Each label's log-probability from the full model's logits over every position, and the
    bound two fp32 computations of it stay within (the chain's worst case, module docstring)."""
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        full = torch.log_softmax(model.model(**inputs).logits.float(), -1)
    expected = torch.zeros(batch["labels"].shape)
    expected[:, 1:] = full[:, :-1].gather(-1, batch["labels"][:, 1:].clamp(min=0)[..., None])[..., 0]
    expected = expected.masked_fill(batch["labels"] == IGNORE, 0.0)
    bound = 2 * gamma(int(sum(tiny_batch_sums(batch["input_ids"])))) * float(expected.abs().max())
    return expected, bound


def test_forward_only_returns_loss_count_and_label_logps_every_call(make_model):
    """Plain eval (the head on the supervised rows; log-probs computed on read) gives each
    label's log-probability of the full model's logits, 0 where the label is -100."""
    model = make_model(init_lora_weights=False)
    batch = pair_batch(model.tokenizer)
    out = model.forward_only(inputs=batch)
    assert "computed on read" in repr(out)  # no head product until someone reads them
    assert set(out) == {"loss", "num_tokens", "logps"} and float(out) == out["loss"]
    assert out["num_tokens"] == int((batch["labels"][:, 1:] != IGNORE).sum())
    logps = out["logps"]
    expected, bound = direct_label_logps(model, batch)
    assert torch.all(logps[batch["labels"] == IGNORE] == 0)
    assert float((logps - expected).abs().max()) <= bound
    mean = -float(logps.sum()) / out["num_tokens"]  # the token cross-entropy of the same numbers
    assert abs(out["loss"] - mean) <= bound * out["num_tokens"]


def test_reference_free_losses_train_through_the_model(make_model):
    """SimPO, CPO, ORPO need no reference and run packed (the pairs' rows end to end); their
    value is the formula on the model's own log-probs, which ``forward_only`` returns, each in
    its row's place."""
    for loss in (SimPOLoss(), CPOLoss(), ORPOLoss()):
        model = make_model(init_lora_weights=False)
        model.set_loss(loss)
        batch = pair_batch(model.tokenizer)
        out = model.forward_only(inputs=batch)
        expected, bound = direct_label_logps(model, batch)  # each row's values in its own place
        assert float((out["logps"] - expected).abs().max()) <= bound
        shifted = {"labels": batch["labels"]}
        direct = loss(shifted, {"logps": out["logps"].double()})
        assert out["num_tokens"] == 2
        assert abs(out["loss"] - float(direct["loss"]) / 2) <= 1e-5 * max(1.0, abs(out["loss"]))
        assert math.isfinite(model.forward_backward(inputs=batch))


def test_training_raises_the_margin_and_the_metrics_reach_metrics_jsonl(tiny_model_dir, make_model, tmp_path):
    twinkle.initialize(seed=0, run=RunDefaults(output_dir=str(tmp_path), report_to=()))
    model = dpo_model(make_model, beta=0.1)
    model.add_metric(DPOMetric, beta=0.1)
    batch = pair_batch(model.tokenizer)
    losses, metrics = [], []
    for _ in range(6):
        ref = model.forward_only(inputs=batch, disable_lora=True)
        losses.append(model.forward_backward(inputs=batch, ref_outputs=ref))
        model.clip_grad_and_step()
        metrics.append(model.calculate_metric(is_training=True))
    assert losses[-1] < losses[0] - 0.05
    assert metrics[0]["reward_margin"] == pytest.approx(0.0, abs=1e-3)  # step 0: the policy is the reference
    assert metrics[-1]["reward_margin"] > 0.05 and metrics[-1]["reward_accuracy"] == 1.0
    assert metrics[-1]["chosen_reward"] > metrics[-1]["rejected_reward"]
    # the built-in numbers count pairs, named so: the loss is the mean pair loss, accuracy the reward accuracy
    assert metrics[-1]["pairs"] == 2 and "supervised_tokens" not in metrics[-1]
    assert metrics[-1]["accuracy"] == metrics[-1]["reward_accuracy"]
    ref = model.forward_only(inputs=batch, disable_lora=True)
    held_out = model.forward_only(inputs=batch, ref_outputs=ref)
    assert held_out["loss"] == model.calculate_loss() < math.log(2)
    evaluated = model.calculate_metric(is_training=False)
    assert evaluated["reward_accuracy"] == 1.0 and evaluated["pairs"] == 2
    report.finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 6 and all("reward_margin" in r and "chosen_logps" in r for r in train)
    assert train[-1]["reward_margin"] == pytest.approx(metrics[-1]["reward_margin"])
    assert [r for r in records if r["kind"] == "eval"][0]["reward_accuracy"] == 1.0
