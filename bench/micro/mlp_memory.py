"""Memory of a LoRA SwiGLU MLP in training, by the allocations it makes: what its forward keeps
for backward and the most its backward holds on top of that.

    python bench/mlp_memory.py --tokens 256

A Qwen2.5-0.5B-sized MLP (hidden 896, intermediate 4864) with LoRA r=8 on its three
projections, the base in bf16 and the adapters in fp32 (PEFT's default on a bf16 model), as on
a GPU, run on the CPU. Three ways: the three one-node LoRA layers with autograd's SiLU and
product between them, and ``lora_mlp``'s one node keeping four or two intermediate-wide tensors
(the CPU's and the accelerators' default). The numbers come from torch.profiler's
allocation timeline (every tensor allocated and freed in order; ``tests/assets/allocations.py``),
so they are exact and the same on every run; a CUDA allocator would round each block up a
little. Backward's peak is what the last layer's MLP adds to a step's peak when that peak falls
in its backward, as it does in W2 on the H200 (``profile_step.py --memory``).
``--tokens`` scales every number linearly; the last column gives them at W2's 3221 tokens in MiB."""

import argparse
import copy
import sys
from pathlib import Path

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.kernel.lora.mlp import lora_mlp

# the allocation timeline the tests assert on, one copy of it
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "assets"))
from allocations import peak_bytes  # noqa: E402

W2_TOKENS = 3221


def _model(hidden: int, inter: int, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(LlamaMLP(config).to(torch.bfloat16), lora)
    for name, param in model.named_parameters():  # B = 0 would make some products trivial
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    fuse_lora_linears(model)
    return model


def measure(mlp: torch.nn.Module, how: str, x: torch.Tensor) -> tuple[int, int, int]:
    """(forward's peak, the bytes it keeps, backward's peak above those) for one way of running
    ``mlp``."""
    if how == "layers":

        def forward():
            return mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    else:

        def forward():
            return lora_mlp(mlp, x, recompute=how == "node, keeps 2")

    out: list[torch.Tensor] = []
    forward_peak, kept = peak_bytes(lambda: out.append(forward()))
    kept -= out[0].nbytes  # the output is the next layer's, not the MLP's
    grad = torch.randn_like(out[0])
    peak, _ = peak_bytes(lambda: out.pop().backward(grad))
    return forward_peak, kept, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = _model(args.hidden, args.intermediate, args.rank)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    wide = args.tokens * args.intermediate * 2  # one intermediate-wide bf16 tensor
    scale = W2_TOKENS / args.tokens / 2**20
    print(
        f"{args.tokens} tokens; unit: one {args.tokens} x {args.intermediate} bf16 tensor ({wide / 2**20:.2f} MiB)"
    )
    print(
        f"{'how':<16}{'forward peak':>14}{'keeps':>8}{'backward peak':>15}{'keeps + peak':>14}{'at W2, MiB':>12}"
    )
    for how in ("layers", "node, keeps 4", "node, keeps 2"):
        mlp = copy.deepcopy(model).base_model.model
        forward_peak, kept, peak = measure(mlp, how, x)
        print(
            f"{how:<16}{forward_peak / wide:>14.2f}{kept / wide:>8.2f}{peak / wide:>15.2f}"
            f"{(kept + peak) / wide:>14.2f}{(kept + peak) * scale:>12.0f}"
        )


if __name__ == "__main__":
    main()
