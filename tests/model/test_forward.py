"""``compute_loss`` equals the cross-entropy of the model's own logits, whatever the head and
the labels at padding."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from tiny import TINY_LLAMA_SHAPE
from tolerances import chain_tolerances, tiny_llama_sums

from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.loss import CrossEntropyLoss, FusedLinearCrossEntropyLoss
from twinkle.model.forward import compute_loss

VOCAB, IGNORE = 64, -100


def _llama(tied: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_LLAMA_SHAPE, vocab_size=VOCAB, tie_word_embeddings=tied, attn_implementation="sdpa"
    )
    return transformers.LlamaForCausalLM(config)


def _batch(lengths: list[int], label_pads: bool) -> dict[str, torch.Tensor]:
    """Right-padded rows, prompt (3 tokens) unscored; pads labelled -100 or, as a user's own
    batch might have them, with the pad token itself."""
    width = max(lengths)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(lengths), width))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    labels = ids.clone() if label_pads else ids.masked_fill(mask == 0, IGNORE)
    labels[:, :3] = IGNORE
    positions = (torch.arange(width)[None, :] * mask).long()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions}


def _reference(model, batch) -> torch.Tensor:
    """Summed CE of the model's real logits over real (non-pad) positions with a label."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def _assert_same_loss(loss_sum: torch.Tensor, expected: torch.Tensor, batch) -> None:
    """Padded, packed or through the fused head: the same token losses summed in other orders,
    within the first-order bound of the tiny Llama's forward (tolerances.py) and of the sum over
    the batch's tokens (~1e-4 of the loss). A pad scored or the head's LoRA left out changes the
    sum by a token's loss, about ln(64) ~ 4 here."""
    sums = tiny_llama_sums(batch["input_ids"].shape[1], VOCAB) + [batch["input_ids"].numel()]
    torch.testing.assert_close(loss_sum, expected, **chain_tolerances(sums, expected))


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_lora_on_the_head_is_in_the_loss_and_trains(padding_free):
    model = get_peft_model(
        _llama(tied=False),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False),
    )
    fuse_lora_linears(model)
    batch = _batch([10, 8, 10], label_pads=False)
    expected = _reference(model, batch)
    for loss_fn in (CrossEntropyLoss(), FusedLinearCrossEntropyLoss()):
        model.zero_grad()
        out = compute_loss(model, batch, loss_fn, padding_free=padding_free)
        _assert_same_loss(out.loss_sum, expected, batch)
        out.loss_sum.backward()
        grad = model.base_model.model.lm_head.lora_B["default"].weight.grad
        assert grad is not None and grad.abs().sum() > 0, "the head's LoRA got no gradient"


@pytest.mark.parametrize("padding_free", [False, True])
def test_pads_are_never_targets_whatever_their_label(padding_free):
    model = _llama(tied=True)
    clean, labelled = _batch([10, 7, 9], label_pads=False), _batch([10, 7, 9], label_pads=True)
    assert (labelled["labels"] != clean["labels"]).any()  # pads carry labels in one of them
    expected = _reference(model, clean)
    for batch in (clean, labelled):
        out = compute_loss(model, batch, CrossEntropyLoss(), padding_free=padding_free)
        _assert_same_loss(out.loss_sum, expected, batch)
        assert out.num_tokens == int((clean["labels"][:, 1:] != IGNORE).sum())
