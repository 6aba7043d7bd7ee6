"""The loss protocol (``twinkle.loss.base``): a loss declares what it consumes and the model
computes that once; a new loss is one file (``TokenWeightedCrossEntropyLoss``); plain callables
are wrapped once by ``set_loss``; the fused choices are explicit."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from batches import padded_batches
from tiny import TINY_LLAMA_SHAPE
from tolerances import chain_tolerances, tiny_batch_sums, tiny_llama_sums

import twinkle.loss.liger_fused_linear_cross_entropy as liger_module
import twinkle.model.transformers_model as tm
from twinkle.loss import (
    LOSSES,
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    HeadLoss,
    LigerFusedLinearCrossEntropyLoss,
    Loss,
    LossView,
    UpstreamLoss,
    as_loss,
    build_loss,
)
from twinkle.loss.importance_sampling import ImportanceSamplingLoss
from twinkle.loss.ppo import PPOLoss
from twinkle.loss.registry import loss_record
from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
from twinkle.model.forward import compute_loss
from twinkle.utils.errors import UserError

VOCAB, IGNORE = 64, -100


def _llama(tied: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_LLAMA_SHAPE, vocab_size=VOCAB, tie_word_embeddings=tied, attn_implementation="sdpa"
    )
    return transformers.LlamaForCausalLM(config)


def _batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded rows, the first 3 tokens unscored, and a weight per label in [0, 2)."""
    width = max(lengths)
    torch.manual_seed(1)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), width)) * mask
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :3] = IGNORE
    positions = (torch.arange(width)[None, :] * mask).long()
    weights = torch.rand(len(lengths), width) * 2
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": positions,
        "loss_weights": weights,
    }


def _weighted_reference(model, batch) -> torch.Tensor:
    """``sum(w * CE)`` from the model's real logits: position t predicts label t+1 with its weight."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return (per_token * batch["loss_weights"][:, 1:].reshape(-1)).sum()


@pytest.mark.parametrize("tied", [False, True])
def test_token_weighted_ce_weighs_each_supervised_token(tied):
    model = _llama(tied)
    batch = _batch([10, 7, 9])
    expected = _weighted_reference(model, batch)
    out = compute_loss(model, batch, TokenWeightedCrossEntropyLoss(), padding_free=True)
    sums = tiny_llama_sums(batch["input_ids"].shape[1], VOCAB) + [batch["input_ids"].numel()]
    torch.testing.assert_close(out.loss_sum, expected, **chain_tolerances(sums, expected))
    assert out.num_tokens == int((batch["labels"][:, 1:] != IGNORE).sum())
    # weights differ from 1 by ~0.5 a token: the unweighted loss is far outside the tolerance
    plain = compute_loss(model, batch, CrossEntropyLoss(reduction="sum")).loss_sum
    assert not torch.allclose(plain, expected, **chain_tolerances(sums, expected))
    # a zero weight takes the token out of the loss and out of the gradient
    batch["loss_weights"][1:] = 0
    only_first = compute_loss(model, batch, TokenWeightedCrossEntropyLoss()).loss_sum
    first = {k: v[:1, :10] for k, v in batch.items()}
    torch.testing.assert_close(
        only_first, _weighted_reference(model, first), **chain_tolerances(sums, expected)
    )


def test_token_weighted_ce_trains_through_the_model(make_model, dataset):
    model = make_model()
    model.set_loss(TokenWeightedCrossEntropyLoss)
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    with pytest.raises(UserError, match=r"needs the batch tensor\(s\) \['loss_weights'\]; add them"):
        model.forward_backward(inputs=batch)
    weighted = dict(batch, loss_weights=torch.zeros(batch["labels"].shape))
    assert model.forward_backward(inputs=weighted) == 0.0  # every token weighs nothing
    grads = [p.grad for p in model.model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().sum()) == 0 for g in grads)
    ones = dict(batch, loss_weights=torch.ones(batch["labels"].shape))
    model.set_loss("CrossEntropyLoss", reduction="sum")
    ce = torch.tensor(model.forward_only(inputs=batch)["loss"])
    model.set_loss(TokenWeightedCrossEntropyLoss)
    weighted_ce = torch.tensor(model.forward_only(inputs=ones)["loss"])
    # all-ones weights: plain cross-entropy, summed in another order (padded, not packed)
    torch.testing.assert_close(weighted_ce, ce, **chain_tolerances(tiny_batch_sums(batch["input_ids"]), ce))


def test_set_loss_wraps_a_callable_once_and_keeps_a_loss(make_model):
    model = make_model()

    def my_loss(inputs, outputs):
        return outputs["logps"].sum()

    model.set_loss(my_loss)
    wrapped = model.optimizer_group["default"].loss_fn
    assert isinstance(wrapped, UpstreamLoss) and wrapped.fn is my_loss and wrapped.name == "my_loss"
    assert as_loss(wrapped) is wrapped and "loss=my_loss " in model.get_train_configs()
    loss = CrossEntropyLoss()
    model.set_loss(loss)
    assert model.optimizer_group["default"].loss_fn is loss

    class Odd(Loss):
        consumes = "everything"

    with pytest.raises(
        UserError, match=r"Odd.consumes='everything'; use 'rows', 'positions' or 'embeddings'"
    ):
        as_loss(Odd())


def test_fused_lm_ce_swap_is_logged(make_model, dataset, monkeypatch):
    logged = []
    monkeypatch.setattr(tm.logger, "info", lambda msg, *args, **kw: logged.append(msg % args))
    model = make_model()
    batch = next(iter(padded_batches(dataset, batch_size=2)))
    model.forward_backward(inputs=batch, task="fused_lm_ce")
    assert isinstance(model.optimizer_group["default"].loss_fn, FusedLinearCrossEntropyLoss)
    assert [m for m in logged if "replaced by FusedLinearCrossEntropyLoss" in m] == [
        "task='fused_lm_ce': CrossEntropyLoss(reduction='sum') replaced by FusedLinearCrossEntropyLoss "
        "(the same cross-entropy, one chunk of logits at a time)"
    ]


def _rows(seed: int = 0):
    torch.manual_seed(seed)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    return hidden, weight, torch.randint(0, 50, (23,))


def test_liger_loss_runs_liger_kernel_where_available(monkeypatch):
    calls = []

    def fake_liger(hidden, weight, targets, bias=None, ignore_index=IGNORE, reduction="mean"):
        calls.append((ignore_index, reduction))
        return F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction=reduction)

    monkeypatch.setattr(liger_module, "liger_kernel_for", lambda hidden: fake_liger)
    hidden, weight, targets = _rows()
    out = LigerFusedLinearCrossEntropyLoss(chunk_rows=5).compute(
        LossView(targets=targets, hidden=hidden, weight=weight)
    )
    assert calls == [(IGNORE, "sum")]
    logits = F.linear(hidden, weight).detach()
    assert torch.equal(out.loss_sum, F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum"))
    expected_correct = (logits.gather(1, targets[:, None]).squeeze(1) == logits.amax(-1)).sum()
    assert int(out.num_correct) == int(expected_correct) and out.num_tokens == 23
    out.loss_sum.backward()
    assert hidden.grad is not None and weight.grad is not None


def test_liger_loss_without_liger_is_twinkles_fused_kernel_bit_for_bit(monkeypatch):
    monkeypatch.setattr(liger_module, "_liger_function", lambda: None)
    hidden, weight, targets = _rows(1)
    assert liger_module.liger_kernel_for(hidden) is None
    view = LossView(targets=targets, hidden=hidden, weight=weight)
    ours = LigerFusedLinearCrossEntropyLoss(chunk_rows=5).compute(view)
    fused = FusedLinearCrossEntropyLoss(chunk_rows=5).compute(view)
    assert torch.equal(ours.loss_sum, fused.loss_sum) and torch.equal(ours.num_correct, fused.num_correct)


class _Recorder(CrossEntropyLoss):
    """Cross-entropy that keeps the view it was handed."""

    extra_inputs = ("advantages", "loss_weights")

    def compute(self, view):
        self.view = view
        return super().compute(view)


def test_extra_inputs_reach_the_loss_at_its_rows_or_as_they_are():
    model = _llama(tied=False)
    batch = _batch([10, 7, 9])
    batch["advantages"] = torch.tensor([0.5, -1.0, 2.0])  # one per sample, as GRPO's
    loss = _Recorder(reduction="sum")
    compute_loss(model, batch, loss)
    targets = batch["labels"][:, 1:]
    sample, position = (targets != IGNORE).nonzero(as_tuple=True)
    assert torch.equal(loss.view.targets, targets[sample, position])
    assert torch.equal(loss.view.extras["advantages"], batch["advantages"][sample])
    assert torch.equal(loss.view.extras["loss_weights"], batch["loss_weights"][:, 1:][sample, position])

    seen = {}

    def upstream(inputs, outputs):
        seen.update(inputs)
        return outputs["logps"].sum()

    upstream.extra_inputs = ("advantages",)
    compute_loss(model, batch, upstream)
    assert seen["advantages"] is batch["advantages"] and seen["loss_weights"] is batch["loss_weights"]
    del batch["advantages"]
    with pytest.raises(UserError, match=r"the loss upstream needs the batch tensor\(s\) \['advantages'\]"):
        compute_loss(model, batch, upstream)


def test_each_loss_implements_one_entry_point():
    """A ``HeadLoss`` implements ``compute(view)`` (the model's path) and takes upstream's call
    from ``twinkle.loss.base``; a ``Loss`` of upstream's convention implements ``__call__`` and
    takes ``compute`` from there."""
    classes = [*LOSSES.values(), ImportanceSamplingLoss, PPOLoss, TokenWeightedCrossEntropyLoss]
    for cls in classes:
        own = {
            name
            for klass in cls.__mro__
            if klass not in (HeadLoss, Loss, object)
            for name in ("compute", "__call__", "from_outputs", "head_loss", "logits_loss")
            if name in vars(klass)
        }
        assert own == ({"compute"} if issubclass(cls, HeadLoss) else {"__call__"}), cls.__name__


def test_upstreams_call_runs_compute_on_the_rows_with_their_extra_inputs():
    torch.manual_seed(3)
    labels = torch.randint(0, VOCAB, (3, 6))
    labels[:, :2] = IGNORE
    labels[2, 4:] = IGNORE
    logits = torch.randn(3, 6, VOCAB, requires_grad=True)
    weights = torch.rand(3, 6) * 2
    mask = labels != IGNORE
    per_token = F.cross_entropy(logits[mask], labels[mask], reduction="none")
    loss = TokenWeightedCrossEntropyLoss()
    out = loss({"labels": labels, "loss_weights": weights}, {"logits": logits})
    # the same per-token terms and weights, summed in the same order
    torch.testing.assert_close(out["loss"], (per_token * weights[mask]).sum(), rtol=1e-6, atol=0)
    assert out["num_tokens"] == int(mask.sum())
    per_row = torch.tensor([0.5, 1.0, 2.0])  # one weight per row holds for each of its labels
    by_row = loss({"labels": labels, "loss_weights": per_row}, {"logits": logits})
    expected = (per_token * per_row[:, None].expand(3, 6)[mask]).sum()
    torch.testing.assert_close(by_row["loss"], expected, rtol=1e-6, atol=0)
    with pytest.raises(UserError, match=r"^TokenWeightedCrossEntropyLoss needs inputs\['loss_weights'\]; "):
        loss({"labels": labels}, {"logits": logits})
    with pytest.raises(
        UserError, match=r"^inputs\['loss_weights'\] has shape \(2,\), but the labels are 3 x 6"
    ):
        loss({"labels": labels, "loss_weights": torch.ones(2)}, {"logits": logits})
    with pytest.raises(UserError, match=r"^TokenWeightedCrossEntropyLoss needs the logits; pass outputs"):
        loss({"labels": labels, "loss_weights": weights}, {"logps": torch.zeros(3, 6)})
    with pytest.raises(UserError, match=r"^CrossEntropyLoss needs outputs\['logps'\] or outputs\['logits'\]"):
        CrossEntropyLoss()({"labels": labels}, {})


# Settings other than the defaults for the registered losses, so that a record that drops or
# renames one rebuilds another loss.
NON_DEFAULT = {
    "CrossEntropyLoss": {"ignore_index": 3, "reduction": "sum", "dft": True},
    "ChunkedCrossEntropyLoss": {"chunk_size": 7, "ignore_index": 2, "reduction": "sum", "dft": True},
    "FusedLinearCrossEntropyLoss": {"reduction": "mean", "chunk_rows": 5},
    "LigerFusedLinearCrossEntropyLoss": {"reduction": "mean", "chunk_rows": 5},
    "MSELoss": {},
    "DPOLoss": {"beta": 0.3, "label_smoothing": 0.2, "reference_free": True, "sft_weight": 0.5},
    "SimPOLoss": {"beta": 2.0, "gamma": 0.4},
    "CPOLoss": {"beta": 0.2, "bc_coef": 0.7},
    "ORPOLoss": {"lambda_orpo": 0.3},
    "GRPOLoss": {"epsilon": 0.1, "epsilon_high": 0.28, "beta": 0.04},
    "GSPOLoss": {"epsilon": 1e-3, "epsilon_high": 2e-3, "beta": 0.1},
    "DRGRPOLoss": {"epsilon": 0.1, "beta": 0.1, "max_tokens": 64},
    "CISPOLoss": {"epsilon": 0.1, "epsilon_high": 0.3},
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_checkpoints_record_rebuilds_every_registered_loss(name):
    """``loss_record`` (what ``trainer_state.json`` holds) rebuilds the same loss through JSON."""
    settings = NON_DEFAULT.get(name, {})  # a loss registered later: its defaults
    loss = build_loss(name, **settings)
    record = json.loads(json.dumps(loss_record(loss)))
    assert record["loss"] == name and set(settings) <= set(record["loss_args"])
    rebuilt = build_loss(record["loss"], **record["loss_args"])
    assert type(rebuilt) is type(loss) and vars(rebuilt) == vars(loss)


def test_a_loss_whose_arguments_cannot_be_recorded_is_recorded_by_name():
    def my_loss(inputs, outputs):
        return outputs["logps"].sum()

    assert loss_record(as_loss(my_loss)) == {"loss": "UpstreamLoss"}  # a function is no JSON value
    assert loss_record(PPOLoss(old_key="old")) == {"loss": "PPOLoss"}  # **keys: no attribute per key
    assert loss_record(TokenWeightedCrossEntropyLoss()) == {
        "loss": "TokenWeightedCrossEntropyLoss",
        "loss_args": {"reduction": "sum", "weight_key": "loss_weights"},
    }
