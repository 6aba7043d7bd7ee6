"""``forward_backward(inputs, task='embedding')`` with ``InfonceLoss``: the pooled embeddings are
the HF model's final hidden states at each row's last token (or their mean), L2-normalised; the
step's loss equals ``InfonceLoss`` on them; ``EmbeddingMetric`` and ``forward_only`` see them.

Tolerance: the model's pass and the reference HF pass run the same fp32 ops on the same padded
batch: 1e-5 on losses of size ~1."""

import math

import pytest
import torch

from twinkle.loss import InfonceLoss
from twinkle.metric import EmbeddingMetric
from twinkle.model.embedding import embedding_batch, final_hidden
from twinkle.utils.errors import UserError

TEXTS = [("Who are you?", "I am twinkle"), ("Paris", "France"), ("ModelScope", "twinkle Acme")]


def rows_of(tokenizer):
    rows = []
    for query, passage in TEXTS:
        rows.append({"input_ids": tokenizer.encode(query), "labels": [1]})
        rows.append({"input_ids": tokenizer.encode(passage), "labels": 0})
    return rows


def reference(model, rows, pooling):
    batch = embedding_batch(rows, model.tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        ).hidden_states[-1]
    mask = batch["attention_mask"]
    if pooling == "mean":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    else:
        pooled = hidden[torch.arange(len(rows)), mask.sum(1) - 1]
    return torch.nn.functional.normalize(pooled, dim=-1), batch["labels"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_step_loss_is_infonce_of_the_pooled_hidden_states(make_model, pooling):
    model = make_model()
    rows = rows_of(model.tokenizer)
    loss = InfonceLoss(temperature=0.1, pooling=pooling)
    model.set_loss(loss)
    model.add_metric(EmbeddingMetric, is_training=True)
    emb, marks = reference(model, rows, pooling)
    want = float(loss({"labels": marks}, {"embeddings": emb})["loss"])
    got = model.forward_backward(inputs=rows, task="embedding")
    assert got == pytest.approx(want, abs=1e-5)
    model.clip_grad_and_step()
    metrics = model.calculate_metric(is_training=True)
    assert 0.0 <= metrics["retrieval_accuracy"] <= 1.0 and "pos_sim" in metrics
    out = model.forward_only(inputs=rows, task="embedding")
    assert out["embeddings"].shape == (6, model.model.config.hidden_size)
    torch.testing.assert_close(out["embeddings"].norm(dim=-1), torch.ones(6))
    assert out["num_tokens"] == 3
    anchors = [{**row, "labels": [1]} for row in rows]  # texts embedded for search: no pairs, no loss
    alone = model.forward_only(inputs=anchors, task="embedding")
    assert math.isnan(alone["loss"]) and alone["num_tokens"] == 0
    torch.testing.assert_close(alone["embeddings"], out["embeddings"], rtol=0, atol=1e-5)


def test_training_raises_in_batch_retrieval(make_model):
    model = make_model(lr=5e-3)
    rows = rows_of(model.tokenizer)
    model.set_loss(InfonceLoss(temperature=0.1))
    first = model.forward_backward(inputs=rows, task="embedding")
    model.clip_grad_and_step()
    for _ in range(8):
        last = model.forward_backward(inputs=rows, task="embedding")
        model.clip_grad_and_step()
    assert last < first


def test_bad_input_is_one_line(make_model):
    model = make_model()
    rows = rows_of(model.tokenizer)
    with pytest.raises(UserError, match="needs a loss over embeddings"):
        model.forward_backward(inputs=rows, task="embedding")
    model.set_loss(InfonceLoss())
    with pytest.raises(UserError, match="run the step with task='embedding'"):
        model.forward_backward(inputs=rows)
    with pytest.raises(UserError, match=r"2 rows\), got 1 row"):
        model.forward_backward(inputs=rows[:1], task="embedding")
    with pytest.raises(UserError, match="needs labels 1"):
        model.forward_backward(inputs=[{"input_ids": [5, 6], "labels": [1, 0]}] * 2, task="embedding")


def test_a_model_without_hidden_states_is_one_line():
    class NoHidden(torch.nn.Module):
        def get_output_embeddings(self):
            return None

        def forward(self, **kwargs):
            return {"scores": torch.zeros(1)}

    batch = embedding_batch([{"input_ids": [1, 2], "labels": 1}], 0)
    with pytest.raises(UserError, match="needs the model's hidden states; NoHidden returns none"):
        final_hidden(NoHidden(), batch)
