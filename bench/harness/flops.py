"""Model FLOPs a training step executes, and the machine's measured matmul peak.

FLOPs of one step of frozen-base LoRA (a multiply-add counts 2):

    F = P_body * (4 * N_frozen + 6 * N_lora)      decoder linears on every position run
      + P_head * 4 * V * H                         LM head on the positions a side computes
      + 12 * L * d_attn * S                        attention scores and their use

- ``P_body``: positions through the decoder layers. The Trainer route runs the padded batch
  (rows x padded width); Twinkle runs one packed row: no pads, no tail after a sample's last
  target, and the prefix all samples share once (``twinkle.model.packing``).
- ``N_frozen``: weights of the frozen linears LoRA wraps (q, k, v, o, gate, up, down in every
  layer). Forward 2N, backward 2N for the activation gradients; no weight gradients: 4N.
- ``N_lora``: LoRA A and B weights. Forward 2, activation gradients 2, weight gradients 2: 6N.
- ``P_head``: Twinkle applies the head only where the next token is supervised; the Trainer
  route computes logits on every position. ``V x H`` is the head (tied to the frozen embedding,
  so again no weight gradient): 4VH.
- ``S``: causal (query, key) pairs: ``width * (width + 1) / 2`` per row of the padded batch
  (Trainer); per sample of the packed row, its own causal pairs plus its pairs with the shared
  prefix (Twinkle).
  Per pair and layer, ``QK^T`` and ``PV`` cost 2 * 2 * d_attn forward and twice that backward
  (gradients for Q, K, V and P): 12 * d_attn. ``d_attn`` = query heads x head size.

Left out (a few percent): norms, activations, rotary embeddings, softmax, the optimizer, and the
activation gradients of the first layer's input, which autograd skips.

The peak is a timed loop of square matmuls (fp32 on CPU with the run's thread count, bf16 on
CUDA); the best of several rounds counts, as the highest rate this machine sustains."""

import time
from typing import Any

import torch

from twinkle.kernel import cpu_gemm as gemm


def model_shape(model: Any) -> dict[str, int]:
    """Parameter counts of a PEFT LoRA model, for ``step_flops``."""
    from peft.tuners.lora import LoraLayer

    frozen = lora = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            frozen += module.get_base_layer().weight.numel()
            lora += sum(p.numel() for name, p in module.named_parameters() if "lora_" in name)
    base = model.get_base_model()
    vocab, hidden = base.get_output_embeddings().weight.shape
    cfg = base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "frozen_linear_params": frozen,
        "lora_params": lora,
        "vocab": vocab,
        "hidden": hidden,
        "layers": cfg.num_hidden_layers,
        "attention_dim": cfg.num_attention_heads * head_dim,
    }


def step_flops(shape: dict[str, int], step: dict[str, int]) -> float:
    """FLOPs of one step from its record (``common.StepRecord`` as a dict); see the module docstring."""
    body = step["body_positions"] * (4 * shape["frozen_linear_params"] + 6 * shape["lora_params"])
    head = step["head_positions"] * 4 * shape["vocab"] * shape["hidden"]
    attention = 12 * shape["layers"] * shape["attention_dim"] * step["attention_pairs"]
    return float(body + head + attention)


def matmul_peak_gflops(threads: int, rounds: int = 5, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Time square matmuls on this machine in the run's dtype (default: fp32 on CPU with
    ``threads`` threads, bf16 on CUDA). On the CPU in fp32 both libraries torch ships are timed,
    MKL (``torch.mm``) and oneDNN (Twinkle's frozen-weight products, ``twinkle.kernel.cpu_gemm``), and
    the faster one is the peak."""
    cuda = torch.cuda.is_available()
    size = 8192 if cuda else 2048
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    device = "cuda" if cuda else "cpu"
    per_round = 20 if cuda else 4  # about half a second a round either way
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    products = {"torch.mm": lambda: torch.mm(a, b)}
    if not cuda and dtype == torch.float32 and gemm.onednn_enabled():
        products["oneDNN"] = lambda: gemm._linear_pointwise(a, b, None)  # oneDNN itself, not the routing
    by_library = {}
    try:
        for name, product in products.items():
            for _ in range(3):  # warm-up: thread pool, caches, clocks
                product()
            best = float("inf")
            for _ in range(rounds):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(per_round):
                    product()
                if cuda:
                    torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - start) / per_round)
            by_library[name] = 2 * size**3 / best / 1e9
    finally:
        torch.set_num_threads(previous)
    return {
        "gflops": max(by_library.values()),
        "by_library": by_library,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "size": size,
        "threads": threads,
    }
