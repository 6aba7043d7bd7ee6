"""The one-node LoRA MLP equals the layers run one by one, bit for bit, and keeps no more."""

import copy

import pytest
import torch
from allocations import peak_bytes
from masks import record, replay
from peft import LoraConfig, get_peft_model
from tolerances import chain_tolerances
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from twinkle.kernel import KernelChoice, kernelize
from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.kernel.lora.mlp import lora_mlp

HIDDEN, INTER = 24, 40
PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]


class Block(torch.nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        config = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            hidden_act="silu",
            num_attention_heads=4,
            num_key_value_heads=2,
            mlp_bias=bias,
        )
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        return self.mlp(x)


def _pair(dtype=torch.float32, targets=PROJECTIONS, bias=False, **lora):
    """The same LoRA MLP twice: its layers one by one (each a one-node LoRA layer, as Twinkle
    runs them), and kernelized into one node."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **lora)
    layers = get_peft_model(Block(bias).to(dtype), config)
    fuse_lora_linears(layers)
    node = kernelize(copy.deepcopy(layers), {"LlamaMLP": KernelChoice("swiglu_mlp", ("torch",))})
    return layers, node


def _run(model, x, x_grad=True):
    x = x.clone().requires_grad_(x_grad)
    out = model(x)
    out.float().square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, x.grad, grads


def _assert_same(a, b):
    out_a, gx_a, grads_a = a
    out_b, gx_b, grads_b = b
    assert torch.equal(out_a, out_b)
    assert (gx_a is None and gx_b is None) or torch.equal(gx_a, gx_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        assert torch.equal(grads_b[name], grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_node_equals_the_layers_bit_for_bit(dtype):
    # bf16: PEFT keeps the adapters fp32 on a bf16 base; both paths round where PEFT does
    layers, node = _pair(dtype)
    x = torch.randn(2, 7, HIDDEN).to(dtype)
    ours = _run(node, x)
    assert type(ours[0].grad_fn).__name__ == "_LoraMLPBackward"
    theirs = _run(layers, x)
    assert type(theirs[0].grad_fn).__name__ == "_LoraLinearBackward"
    assert len(theirs[2]) == 6  # lora_A and lora_B of three layers
    _assert_same(theirs, ours)


def test_trainable_base_weights_and_biases_and_an_input_without_gradient():
    layers, node = _pair(bias=True)
    for model in (layers, node):
        for name, param in model.named_parameters():
            if "base_layer" in name:
                param.requires_grad_(True)
    x = torch.randn(3, HIDDEN)
    ours, theirs = _run(node, x, x_grad=False), _run(layers, x, x_grad=False)
    assert len(theirs[2]) == 12 and ours[1] is None
    _assert_same(theirs, ours)


def _saved_widths(model, x):
    """The last dimensions of the activations autograd keeps (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    widths = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            widths.append(t.shape[-1] if t.dim() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.requires_grad_())
    return widths


def test_keeps_the_four_intermediate_wide_activations_the_layers_keep():
    layers, node = _pair()
    x = torch.randn(5, HIDDEN)
    # one by one: silu keeps gate, the product keeps silu(gate) and up, down keeps the product
    assert _saved_widths(layers, x.clone()).count(INTER) == 4
    assert _saved_widths(node, x.clone()).count(INTER) == 4


class _Recomputing:
    """The node with ``recompute=True``, its default off the CPU, run here on the CPU."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        return lora_mlp(self.model.base_model.model.mlp, x, recompute=True)

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputing_node_equals_the_layers_and_keeps_two_wide_activations(dtype):
    layers, node = _pair(dtype)
    lean = _Recomputing(node)
    x = torch.randn(2, 7, HIDDEN).to(dtype)
    assert _saved_widths(lean, x.clone()).count(INTER) == 2  # gate and up
    node.zero_grad(set_to_none=True)
    ours = _run(lean, x)
    assert type(ours[0].grad_fn).__name__ == "_LoraMLPBackward"
    _assert_same(_run(layers, x), ours)


def test_steps_aside_where_it_does_not_apply():
    x = torch.randn(2, 3, HIDDEN)
    _, node = _pair()
    assert lora_mlp(node.base_model.model.mlp, x) is not None
    _, partial = _pair(targets=["gate_proj", "up_proj"])  # down is a plain Linear
    assert lora_mlp(partial.base_model.model.mlp, x) is None
    _, dropped = _pair(lora_dropout=0.5)  # dropout runs inside the node
    assert lora_mlp(dropped.base_model.model.mlp, x) is not None
    _, merged = _pair()
    merged.base_model.model.mlp.up_proj.merge()
    assert lora_mlp(merged.base_model.model.mlp, x) is None


def test_with_an_active_dropout_it_equals_the_layers_drawing_the_same_masks(monkeypatch):
    layers, node = _pair(lora_dropout=0.5)
    x = torch.randn(2, 5, HIDDEN)
    drawn = record(monkeypatch)
    torch.manual_seed(3)
    theirs = _run(layers, x)
    torch.manual_seed(3)
    ours = _run(node, x)
    assert type(ours[0].grad_fn).__name__ == "_LoraMLPBackward"
    assert len(drawn) == 6 and drawn[:3] == drawn[3:]  # gate, up, down: the same seeds in order
    # the same masks; gate's and up's adapters run through theirs in one pass, which sums their
    # shares of x's gradient in another order: equal up to that rounding
    assert torch.equal(theirs[0], ours[0])
    torch.testing.assert_close(ours[1], theirs[1], **chain_tolerances(_sums(x), theirs[1]))
    assert theirs[2].keys() == ours[2].keys()
    for name, grad in theirs[2].items():
        torch.testing.assert_close(ours[2][name], grad, **chain_tolerances(_sums(x), grad), msg=name)


def _sums(x) -> list[int]:
    """The block's fp32 sums, forward and backward (tolerances.chain_tolerances): gate/up and
    their rank-r adapters (hidden), down and its adapter (intermediate), the intermediate
    gradient (hidden + r), x's gradient from gate, up and three adapters (2 intermediate + 3 r),
    the weights' gradients (tokens), and a few roundings per element (silu, products, scales).
    A wrong mask or a missing adapter term moves a gradient by ~1e-1 of its scale."""
    rank, tokens = 4, x.numel() // HIDDEN
    return [HIDDEN + rank, INTER + rank, HIDDEN + rank, 2 * INTER + 3 * rank, tokens, 10]


def test_with_an_active_dropout_it_gives_peft_gradients_given_the_same_masks(monkeypatch):
    _, node = _pair(lora_dropout=0.5)
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False, lora_dropout=0.5
    )
    peft_model = get_peft_model(Block(), config)  # PEFT's own forward, no fusing
    x = torch.randn(2, 5, HIDDEN)
    drawn = record(monkeypatch)
    out, gx, grads = _run(node, x)
    queue = replay(peft_model, drawn)
    out_ref, gx_ref, grads_ref = _run(peft_model, x)
    assert not queue
    # equal up to summation order (the masked products' own): the block's chain of fp32 sums
    torch.testing.assert_close(out, out_ref, **chain_tolerances(_sums(x), out_ref))
    torch.testing.assert_close(gx, gx_ref, **chain_tolerances(_sums(x), gx_ref))
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, **chain_tolerances(_sums(x), grad), msg=name)


def test_on_a_bf16_model_backward_frees_each_wide_tensor_and_fp32_copy_after_its_last_use():
    # PEFT keeps the adapters fp32 on a bf16 base, so each intermediate-wide bf16 tensor the
    # adapters read has a copy twice its size. Before the ordering, the recomputing node's
    # backward held 8.3 such tensors on top of what forward kept, and its forward 6.6.
    torch.manual_seed(0)
    wide, tokens = 256, 256
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False)
    block = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=wide, hidden_act="silu"))
    mlp = get_peft_model(block.to(torch.bfloat16), config).base_model.model
    fuse_lora_linears(mlp)
    unit = tokens * wide * 2  # one (tokens, intermediate) bf16 tensor
    x = torch.randn(tokens, 32, dtype=torch.bfloat16, requires_grad=True)
    out = []
    forward_peak, _ = peak_bytes(lambda: out.append(lora_mlp(mlp, x, recompute=True)))
    grad = torch.randn_like(out[0])
    backward_peak, _ = peak_bytes(lambda: out.pop().backward(grad))
    # limits halfway between the two orders (now 5.6 and 4.4), room for a BLAS's scratch buffers
    assert forward_peak / unit < 6.1  # gate, up, the product and its fp32 copy; silu(gate) gone
    assert backward_peak / unit < 6.3
    assert x.grad is not None and mlp.down_proj.lora_A["default"].weight.grad is not None
