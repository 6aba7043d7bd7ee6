"""Every packable family gives the padded batch's loss and gradients when packed, including
Mistral's sliding window shorter than the rows."""

import pytest
import torch
import transformers
from tiny import TINY_LLAMA_SHAPE
from tolerances import chain_tolerances, tiny_batch_sums

from twinkle.loss import CrossEntropyLoss
from twinkle.model.forward import compute_loss
from twinkle.model.packing import PACKABLE_MODEL_TYPES

IGNORE = -100
SMALL = dict(TINY_LLAMA_SHAPE, vocab_size=64, max_position_embeddings=64, attn_implementation="sdpa")
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 5}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 8}),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        {
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    ),
}


def _batch() -> dict[str, torch.Tensor]:
    """Three right-padded rows sharing a 6-token prompt prefix, with different lengths."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, 64, (6,), generator=g).tolist()
    rows = [prefix + torch.randint(1, 64, (n,), generator=g).tolist() for n in (9, 4, 12)]
    width = max(map(len, rows))
    batch = {
        k: torch.zeros(len(rows), width, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    batch["labels"] = torch.full((len(rows), width), IGNORE)
    for i, row in enumerate(rows):
        n = len(row)
        batch["input_ids"][i, :n] = torch.tensor(row)
        batch["attention_mask"][i, :n] = 1
        batch["position_ids"][i, :n] = torch.arange(n)
        batch["labels"][i, 8:n] = torch.tensor(row[8:])  # the answer: after the shared prefix
    return batch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_equals_padded(family):
    assert family in PACKABLE_MODEL_TYPES
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**SMALL, **extra)).float()
    batch = _batch()
    results = []
    for padding_free in (False, True):
        model.zero_grad()
        out = compute_loss(model, batch, CrossEntropyLoss(), padding_free=padding_free)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss_sum.item(), out.num_tokens, grads))
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = results
    assert model.config._attn_implementation.startswith("twinkle_segments:")  # packing really ran
    assert n_a == n_b > 0
    # fp32, other matmul shapes: the same terms in other orders, within the first-order bound of
    # the tiny model's chain of sums (tolerances.py; the MoE's experts are narrower than the dense
    # MLP it assumes) and of the loss summed over the batch's tokens: ~1.5e-4 relative to each
    # tensor's scale. A router's top-2 could flip only on a tie within that, at random init
    # never. A token seeing another sample or past the window moves the loss by a few percent.
    sums = tiny_batch_sums(batch["input_ids"], vocab=64) + [batch["input_ids"].numel()]
    loss_a, loss_b = torch.tensor(loss_a), torch.tensor(loss_b)
    torch.testing.assert_close(loss_b, loss_a, **chain_tolerances(sums, loss_a))
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, **chain_tolerances(sums, grad), msg=name)
