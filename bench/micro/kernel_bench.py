"""The ``torch`` kernel backend against the Hugging Face module it replaces, forward + backward.

    python bench/kernel_bench.py                      # SmolLM2-135M shapes, fp32, 2 threads
    python bench/kernel_bench.py --dtype bfloat16 --repeats 21

For each op, two instances of the same module with the same weights: the original, and one
``kernelize``-d with the op's ``torch`` backend (the real patch path). The timed step is
``forward(x).backward(grad)`` with ``x`` requiring grad, so the input and weight gradients are
both computed. Original and ours alternate inside each repeat (so load from other processes
hits both alike); the table gives the median over repeats of the mean step time in a repeat,
and the speed-up as the median [quartiles] of the per-repeat ratios original / ours.
``--frozen`` gives the weights no gradient, as under LoRA. ``--lora`` runs the MLP with LoRA (r=8)
on its three projections and frozen base weights, as Twinkle trains it: the original is PEFT's
layers (each one autograd node, as ``TransformersModel`` fuses them), ours the one-node MLP.
``saved MB`` is what autograd keeps for backward (distinct storages, parameters excluded).

An op enters ``DEFAULT_KERNEL_CONFIG``'s chains only if ours is more than 5% faster here.

Not named ``kernels.py``: run as a script, that name would shadow the ``kernels`` package that
transformers probes for at import."""

import argparse
import copy
import statistics
import time

import _paths  # noqa: F401  (puts bench/ and bench/harness on sys.path)
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from twinkle.kernel import KernelChoice, kernelize

HIDDEN, INTERMEDIATE, EPS = 576, 1536, 1e-5  # SmolLM2-135M


def _modules() -> dict[str, tuple[str, torch.nn.Module]]:
    """op -> (module class name, an original module with non-trivial weights)."""
    torch.manual_seed(0)
    llama_norm = LlamaRMSNorm(HIDDEN, eps=EPS)
    qwen_norm = Qwen3_5RMSNorm(HIDDEN, eps=EPS)
    for norm in (llama_norm, qwen_norm):
        torch.nn.init.normal_(norm.weight, mean=float(norm is llama_norm), std=0.1)
    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="silu"))
    return {
        "rms_norm": ("LlamaRMSNorm", llama_norm),
        "rms_norm_zero_centered": ("Qwen3_5RMSNorm", qwen_norm),
        "swiglu_mlp": ("LlamaMLP", mlp),
    }


def _step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    x.grad = None
    module.zero_grad(set_to_none=True)
    module(x).backward(grad)


def _time(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        _step(module, x, grad)
    return (time.perf_counter() - start) / iters * 1e3


def _with_lora(mlp: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    from twinkle.kernel.lora.linear import fuse_lora_linears

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(mlp, config)
    for name, param in model.named_parameters():  # B away from zero, so every gradient is non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    assert fuse_lora_linears(model) == 3
    return model


def _saved_mb(module: torch.nn.Module, x: torch.Tensor) -> float:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values()) / 2**20


def _max_diff(original: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Largest absolute difference over the output, the input gradient and each weight gradient."""
    results = []
    for module in (original, ours):
        _step(module, x, grad)
        results.append(
            [module(x).detach(), x.grad] + [p.grad for p in module.parameters() if p.requires_grad]
        )
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*results, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10, help="steps per repeat")
    parser.add_argument("--ops", nargs="*", default=None, help="a subset of the ops")
    parser.add_argument("--frozen", action="store_true", help="weights without gradients, as under LoRA")
    parser.add_argument("--lora", action="store_true", help="the MLP only, with LoRA on its projections")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"batch {args.batch} x seq {args.seq}, hidden {HIDDEN}, intermediate {INTERMEDIATE}, {args.dtype}, "
        f"{args.threads} threads, {'LoRA on frozen' if args.lora else 'frozen' if args.frozen else 'trainable'} weights, median of {args.repeats} repeats x {args.iters} steps, torch {torch.__version__}"
    )
    print(
        "| op | module | original ms | torch ms | speed-up [IQR] | saved MB original | saved MB torch | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for op, (target, original) in _modules().items():
        if args.ops and op not in args.ops:
            continue
        if args.lora and op != "swiglu_mlp":
            continue
        original = original.to(dtype).requires_grad_(not (args.frozen or args.lora))
        if args.lora:
            original = _with_lora(original)
        ours = kernelize(copy.deepcopy(original), {target: KernelChoice(op, ("torch",))})
        patched = [getattr(m, "_twinkle_kernel", None) for m in ours.modules() if type(m).__name__ == target]
        assert patched == [(op, "torch")], f"{target} was not patched"
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.seq, HIDDEN, generator=gen).to(dtype).requires_grad_()
        grad = torch.randn(args.batch, args.seq, HIDDEN, generator=gen).to(dtype)
        diff = _max_diff(original, ours, x, grad)
        for module in (original, ours):  # warm-up
            _time(module, x, grad, args.iters)
        times: dict[str, list[float]] = {"original": [], "torch": []}
        for _ in range(args.repeats):
            times["original"].append(_time(original, x, grad, args.iters))
            times["torch"].append(_time(ours, x, grad, args.iters))
        base, mine = statistics.median(times["original"]), statistics.median(times["torch"])
        ratios = sorted(a / b for a, b in zip(times["original"], times["torch"], strict=True))
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"| {op} | {target} | {base:.3f} | {mine:.3f} | {q2:.2f}x [{q1:.2f}-{q3:.2f}] | "
            f"{_saved_mb(original, x):.2f} | {_saved_mb(ours, x):.2f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
