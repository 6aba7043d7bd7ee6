"""Convergence: the tiny Llama trained a few steps with and without ``kernelize`` (every torch-
backend op forced on) gives the same losses, in full fine-tuning and with LoRA adapters.

Both are checked against a float64 twin of the plain model (``exact``): its roundings are 2^29
times finer, so it is the exact trajectory for these purposes. An fp32 run differs from it by its
own roundings; the kernelized ops sum the same terms in other orders, so on any CPU they stay as
close to it as plain torch does. AdamW can turn a rounding difference into a larger one (an update
is lr * m / sqrt(v): a gradient element near zero can flip the sign of its update), so the plain
fp32 run is held to the same bound: if that premise failed on some CPU the test says the bound,
not the kernels, is at fault."""

import peft
import pytest
import torch
import torch.nn.functional as F
from tolerances import UNIT_ROUNDOFF, gamma, tiny_llama_sums

from twinkle.kernel import kernelize

STEPS = 8
TOKENS = 16


def _batches(n: int) -> list[torch.Tensor]:
    """Counting sequences from random starts: learnable, so the loss falls within a few steps."""
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 100, (n, 4, 1), generator=gen)
    return [(start + torch.arange(TOKENS)) % 100 for start in starts]


def _train(model: torch.nn.Module, lr: float) -> torch.Tensor:
    """The losses of ``STEPS`` AdamW steps, in float64. The loss is the next-token cross entropy
    (what the model's own loss computes) in fp32 for fp32/bf16 logits, in float64 for float64."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for input_ids in _batches(STEPS):
        logits = model(input_ids=input_ids).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def _fp32_bound(exact: torch.Tensor) -> torch.Tensor:
    """Per step: the first-order bound of the tiny Llama's chain of fp32 sums (forward and
    backward, tolerances.py: gamma(1204) ~ 7.2e-5 relative), twice: the step's own roundings and
    what AdamW carried over from the steps before: ~6.6e-4 at a loss of 4.6, where plain torch
    stays within 1/200 of it. A norm kernel that ignores its weight is off by 3.6e-3 at step 0
    (5x the bound); one 1% off by 2-3x the bound from the fourth step."""
    return 2 * gamma(sum(tiny_llama_sums(TOKENS))) * exact.abs()


def _assert_near(losses: torch.Tensor, exact: torch.Tensor, allowed: torch.Tensor, what: str) -> None:
    error = (losses - exact).abs()
    assert (error <= allowed).all(), (
        f"{what}: losses {losses.tolist()} off the float64 run {exact.tolist()} by {error.tolist()}, "
        f"allowed {allowed.tolist()}"
    )


def _assert_converges_alike(base: torch.Tensor, ours: torch.Tensor, exact: torch.Tensor, dtype) -> None:
    assert ours[-1] < ours[0] - 0.05  # it learns
    if dtype == torch.float32:
        allowed = _fp32_bound(exact)
        _assert_near(base, exact, allowed, "plain torch fp32 (the bound's premise; the bound is too tight)")
    else:
        # bf16: a worst-case bound of ~60 bf16 roundings (2^-8 each) along the chain says nothing.
        # The kernelized ops round to bf16 where the modules they replace do, their fp32 sums flip
        # a rounding now and then; so ours stays within twice what bf16 rounding alone does to
        # the plain run, measured here on this CPU (running max over the steps: ~1e-4 at step 0,
        # 1.5e-3 later), plus the fp32 loss's own roundings. A norm kernel that ignores its weight
        # is off by 18x the allowance at step 0; a 1% error (2.5 bf16 ulps) is at its edge.
        measured = torch.cummax((base - exact).abs(), 0).values
        allowed = 2 * measured + 2 * UNIT_ROUNDOFF[torch.float32] * exact.abs() * STEPS
    _assert_near(ours, exact, allowed, f"kernelized {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_finetune_losses_match(tiny_llama, torch_mapping, dtype):
    exact = _train(tiny_llama().double(), lr=1e-3)
    base = _train(tiny_llama().to(dtype), lr=1e-3)
    ours = _train(kernelize(tiny_llama().to(dtype), torch_mapping), lr=1e-3)
    _assert_converges_alike(base, ours, exact, dtype)


def test_lora_losses_match(tiny_llama, torch_mapping):
    """The order the trainer uses: kernelize, then attach LoRA (the MLP's projections included)."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def lora(model):
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

    exact = _train(lora(tiny_llama()).double(), lr=1e-2)
    base = _train(lora(tiny_llama()), lr=1e-2)
    ours = _train(lora(kernelize(tiny_llama(), torch_mapping)), lr=1e-2)
    _assert_converges_alike(base, ours, exact, torch.float32)
