"""Convergence: the tiny Llama trained a few steps with and without ``kernelize`` (every torch-
backend op forced on) gives the same losses, in full fine-tuning and with LoRA adapters."""

import peft
import pytest
import torch

from twinkle.kernel import kernelize

STEPS = 8


def _batches(n: int) -> list[torch.Tensor]:
    """Counting sequences from random starts: learnable, so the loss falls within a few steps."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 100, (n, 4, 1), generator=gen)
    return [(start + torch.arange(16)) % 100 for start in starts]


def _train(model: torch.nn.Module, lr: float) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for input_ids in _batches(STEPS):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# (dtype, loss atol, loss rtol) over 8 AdamW steps. fp32: the ops agree to a few ulp per step
# (on this model the losses come out identical); 1e-5 leaves room for another CPU's reduction
# order. bf16: one flipped bf16 rounding (2**-8 relative) in a weight update moves every later
# loss; we see 3e-4 at a loss of 4.5, the bound is 15x that (Liger's convergence tests allow more).
CONVERGENCE = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 5e-3, 0.0, id="bf16"),
]


@pytest.mark.parametrize("dtype, atol, rtol", CONVERGENCE)
def test_full_finetune_losses_match(tiny_llama, torch_mapping, dtype, atol, rtol):
    base = _train(tiny_llama().to(dtype), lr=1e-3)
    ours = _train(kernelize(tiny_llama().to(dtype), torch_mapping), lr=1e-3)
    assert ours[-1] < ours[0] - 0.05  # it learns
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(base), atol=atol, rtol=rtol)


def test_lora_losses_match(tiny_llama, torch_mapping):
    """The order the trainer uses: kernelize, then attach LoRA (the MLP's projections included)."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def lora(model):
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

    base = _train(lora(tiny_llama()), lr=1e-2)
    ours = _train(lora(kernelize(tiny_llama(), torch_mapping)), lr=1e-2)
    assert ours[-1] < ours[0] - 0.05
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(base), atol=1e-5, rtol=1e-5)
