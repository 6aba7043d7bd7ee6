"""The MoE router's load-balancing loss joins a training step when the config asks for it
(``output_router_logits=True``), weighed by ``router_aux_loss_coef`` as transformers weighs it
(``twinkle.model.router_aux``).

Tolerances. A step against transformers' own ``outputs.loss`` (labels given) and its
``loss.backward()``: the same terms summed in other orders (the head apart from the model, packed
rows), so the loss, the aux and every gradient are within the first-order bound of the tiny
model's chain of sums (``chain_tolerances`` of ``llama_sums``; the aux adds one sum over the
experts and one over the routed tokens). A router's top-2 could flip only on a near tie within
that bound, at random init never. Dropping the aux moves the router's gradient by a sizeable
fraction of its scale (checked below), orders beyond the bound."""

import json
import shutil

import pytest
import torch
import transformers
from peft import LoraConfig
from tolerances import chain_tolerances, llama_sums

from twinkle.model import TransformersModel
from twinkle.model.forward import compute_loss
from twinkle.model.router_aux import router_aux_of

IGNORE = -100
COEF = 0.5  # large, so the aux's gradient is a visible share of the router's
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers, hidden 64, 4 experts, top-2, fp32) whose config asks for the
    aux, with the tiny tokenizer."""
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    ids = {k: ids.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}
    config = transformers.Qwen3MoeConfig(
        **SHAPE, **ids, output_router_logits=True, router_aux_loss_coef=COEF, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


def _batch() -> dict[str, torch.Tensor]:
    """Three right-padded rows of different lengths sharing a 6-token prefix; the answers after
    position 8 are supervised, and each row ends in tokens after its last target."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, 500, (6,), generator=g).tolist()
    rows = [prefix + torch.randint(1, 500, (n,), generator=g).tolist() for n in (11, 5, 14)]
    width = max(map(len, rows)) + 2
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
        batch["labels"][i, 8 : n - 1] = torch.tensor(row[8 : n - 1])  # the last token unsupervised
    return batch


def _tolerances(reference: torch.Tensor) -> dict:
    batch = _batch()
    tokens = batch["input_ids"].shape[1]
    sums = llama_sums(64, 128, 2, tokens, 600) + [batch["input_ids"].numel(), 2 * SHAPE["num_experts"]]
    return chain_tolerances(sums, reference)


def _hf(moe_dir, **config) -> tuple[torch.nn.Module, object]:
    """transformers' model on the batch, labels given: its loss (token mean plus coef * aux)
    backpropagated."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, **config)
    out = ref(**_batch())
    out.loss.backward()
    return ref, out


def _step(moe_dir, padding_free: bool, lora: bool = False, **config):
    """One twinkle step on the batch: (its outputs, the model, the step's gradients made means)."""
    kwargs = {"config": transformers.AutoConfig.from_pretrained(moe_dir, **config)} if config else {}
    model = TransformersModel(str(moe_dir), dtype=torch.float32, padding_free=padding_free, **kwargs)
    if lora:
        model.add_adapter_to_model(
            "default", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    out = model.forward_backward(inputs=_batch())
    grads = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad / out.get("num_tokens")
        for n, p in model.model.named_parameters()
        if p.grad is not None
    }
    return out, model, grads


def test_step_loss_and_gradients_equal_transformers(moe_dir):
    ref, hf = _hf(moe_dir)
    out, model, grads = _step(moe_dir, padding_free=False)
    assert router_aux_of(model.model) is not None
    assert float(hf.aux_loss.detach()) > 0
    torch.testing.assert_close(
        torch.tensor(out.get("aux_loss")), hf.aux_loss.detach(), **_tolerances(hf.aux_loss)
    )
    torch.testing.assert_close(torch.tensor(float(out)), hf.loss.detach(), **_tolerances(hf.loss))
    routers = [n for n in grads if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    for name, param in ref.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, **_tolerances(param.grad), msg=name)


def test_the_aux_moves_the_router_gradient(moe_dir):
    """Without the aux the router's gradient is another one: the check above can fail."""
    _, with_aux, _ = _step(moe_dir, padding_free=False)
    _, _, without = _step(moe_dir, padding_free=False, output_router_logits=False)
    _, _, grads = _step(moe_dir, padding_free=False)
    for name in [n for n in grads if n.endswith("mlp.gate.weight")]:
        scale = grads[name].abs().max()
        assert (grads[name] - without[name]).abs().max() > 0.05 * scale, name


def test_lora_gradients_equal_transformers(moe_dir):
    """LoRA on attention (PEFT does not reach the router, a bare weight): the aux's gradient flows
    through the hidden states into every adapter below the routers."""
    _, hf = _hf(moe_dir)
    out, model, grads = _step(moe_dir, padding_free=False, lora=True)
    torch.testing.assert_close(torch.tensor(float(out)), hf.loss.detach(), **_tolerances(hf.loss))
    ref, _ = _hf(moe_dir)
    assert any("lora_A" in n for n in grads)
    # an adapter at init (B = 0) has A's gradient 0 and B's gradient (x A)^T dL/dy: compare B's
    # with transformers' through the same A
    peft_model = model.model
    for name, param in peft_model.named_parameters():
        if "lora_B" not in name or param.grad is None:
            continue
        base = name.replace("base_model.model.", "").replace(".lora_B.default.weight", "")
        a = dict(peft_model.named_parameters())[name.replace("lora_B", "lora_A")]
        scaling = 8 / 4
        out_grad = dict(ref.named_parameters())[base + ".weight"].grad  # dL/dW = dL/dy^T x
        expected = scaling * out_grad @ a.detach().T
        torch.testing.assert_close(
            param.grad / out.get("num_tokens"), expected, **_tolerances(expected), msg=name
        )


def test_packed_equals_padded(moe_dir):
    padded, _, grads_a = _step(moe_dir, padding_free=False)
    packed, model, grads_b = _step(moe_dir, padding_free=True)
    assert model.model.config._attn_implementation.startswith("twinkle_segments:")  # packing ran
    ref = torch.tensor(padded.get("aux_loss"))
    torch.testing.assert_close(torch.tensor(packed.get("aux_loss")), ref, **_tolerances(ref))
    torch.testing.assert_close(torch.tensor(float(packed)), torch.tensor(float(padded)), **_tolerances(ref))
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, **_tolerances(grad), msg=name)


def test_off_is_the_token_loss_bit_for_bit(moe_dir):
    """``output_router_logits=False`` (transformers' default): no hook, and the step's loss and
    gradients are those of the token loss's forward and backward alone, bit for bit."""
    off, model, grads = _step(moe_dir, padding_free=True, output_router_logits=False)
    assert router_aux_of(model.model) is None and "aux_loss" not in off
    model.model.zero_grad()
    plain = compute_loss(model.model, _batch(), model._group(None).loss_fn, padding_free=True)
    plain.loss_sum.backward()
    assert float(off) == float(plain.loss_sum.detach()) / plain.num_tokens
    for name, param in model.model.named_parameters():
        assert torch.equal(param.grad / plain.num_tokens, grads[name]), name


def test_no_aux_without_a_coefficient(moe_dir):
    out, model, _ = _step(moe_dir, padding_free=True, router_aux_loss_coef=0.0)
    assert router_aux_of(model.model) is None and "aux_loss" not in out


def test_calculate_metric_reports_the_aux(moe_dir):
    out, model, _ = _step(moe_dir, padding_free=True)
    model.set_optimizer("AdamW", lr=1e-3)
    metrics = model.calculate_metric(is_training=True)
    assert metrics["aux_loss"] == pytest.approx(out.get("aux_loss"))
    assert "loss" in metrics and metrics["loss"] < float(out)  # the token loss, beside the aux
