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
from batches import prefix_batch
from peft import LoraConfig, get_peft_model
from tolerances import chain_tolerances, llama_sums

from twinkle.loss import InfonceLoss
from twinkle.model import TransformersModel
from twinkle.model.embedding import embedding_batch
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


def _batch(lengths: tuple[int, ...] = (11, 5, 14), seed: int = 0) -> dict[str, torch.Tensor]:
    return prefix_batch(lengths, seed)


def _tolerances(reference: torch.Tensor) -> dict:
    batch = _batch()
    tokens = batch["input_ids"].shape[1]
    sums = llama_sums(64, 128, 2, tokens, 600) + [batch["input_ids"].numel(), 2 * SHAPE["num_experts"]]
    return chain_tolerances(sums, reference)


def _hf(moe_dir, *batches: dict) -> tuple[torch.nn.Module, object]:
    """transformers' model on the batch (or the mean of its losses on ``batches``), labels given:
    its loss (token mean plus coef * aux) backpropagated."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    outs = [ref(**batch) for batch in batches or [_batch()]]
    (sum(out.loss for out in outs) / len(outs)).backward()
    return ref, outs[0]


def _step(moe_dir, padding_free: bool, **config):
    """One twinkle step on the batch: (its outputs, the model, the step's gradients made means)."""
    kwargs = {"config": transformers.AutoConfig.from_pretrained(moe_dir, **config)} if config else {}
    model = TransformersModel(str(moe_dir), dtype=torch.float32, padding_free=padding_free, **kwargs)
    out = model.forward_backward(inputs=_batch())
    grads = {
        n: p.grad / out.get("num_tokens") for n, p in model.model.named_parameters() if p.grad is not None
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
    _, _, without = _step(moe_dir, padding_free=False, output_router_logits=False)
    _, _, grads = _step(moe_dir, padding_free=False)
    for name in [n for n in grads if n.endswith("mlp.gate.weight")]:
        scale = grads[name].abs().max()
        assert (grads[name] - without[name]).abs().max() > 0.05 * scale, name


def test_lora_on_the_router_equals_transformers(moe_dir):
    """LoRA on the router (PEFT's ``target_parameters``: the router's weight is a bare parameter)
    and on attention, A and B random: every adapter weight's gradient equals that of PEFT on
    transformers' model with the same adapter weights."""
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=["mlp.gate.weight"]
    )
    lora.init_lora_weights = False  # B random too: every adapter weight has a gradient
    model = TransformersModel(str(moe_dir), dtype=torch.float32, padding_free=False)
    torch.manual_seed(0)
    model.add_adapter_to_model("default", lora)
    out = model.forward_backward(inputs=_batch())
    ours = {n: p for n, p in model.model.named_parameters() if "lora_" in n}
    assert any(".mlp.gate." in n for n in ours)
    base = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    ref = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "lora_" in name:
                param.copy_(ours[name])
    hf = ref(**_batch())
    hf.loss.backward()
    torch.testing.assert_close(torch.tensor(float(out)), hf.loss.detach(), **_tolerances(hf.loss))
    for name, param in ref.named_parameters():
        if "lora_" in name:
            grad = ours[name].grad / out.get("num_tokens")
            torch.testing.assert_close(grad, param.grad, **_tolerances(param.grad), msg=name)


def test_activation_checkpointing_keeps_the_aux(moe_dir):
    """Layers recomputed in the backward: the aux's gradient reaches the routers through the
    recomputed layers, and the recomputed routers add nothing to it."""
    _, _, plain = _step(moe_dir, padding_free=True)
    model = TransformersModel(str(moe_dir), dtype=torch.float32, activation_checkpointing="on")
    out = model.forward_backward(inputs=_batch())
    assert "aux_loss" in out
    for name, param in model.model.named_parameters():
        grad = param.grad / out.get("num_tokens")
        torch.testing.assert_close(grad, plain[name], **_tolerances(plain[name]), msg=name)


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


def test_a_window_of_two_micro_batches_averages_their_aux(moe_dir):
    """Two micro-batches of one window, with as many targets each: the step is transformers' mean
    of the two losses, each with its own aux (``RouterAux.step_term``: a micro-batch's aux weighs
    its share of the window's targets, here one half)."""
    first, second = _batch((11,), seed=1), _batch((7, 7), seed=2)  # 8 targets each
    ref, _ = _hf(moe_dir, first, second)
    model = TransformersModel(str(moe_dir), dtype=torch.float32)
    model.set_optimizer("AdamW", lr=1e-3)
    for batch in (first, second):
        model.forward_backward(inputs=batch)
    model.clip_grad_norm(0)  # the window's gradients made its mean; measured only
    grads = dict(model.model.named_parameters())
    for name, param in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, **_tolerances(param.grad), msg=name)


def test_an_embedding_step_adds_the_aux_of_its_padded_rows(moe_dir):
    """``task='embedding'`` trains the routers too: its step's aux is transformers' over the rows'
    real tokens (pads excluded)."""
    model = TransformersModel(str(moe_dir), dtype=torch.float32)
    model.set_loss(InfonceLoss(temperature=0.1))
    g = torch.Generator().manual_seed(3)
    rows = [
        {"input_ids": torch.randint(1, 500, (n,), generator=g).tolist(), "labels": [1] if i % 2 == 0 else 0}
        for i, n in enumerate((9, 5, 12, 7))
    ]
    out = model.forward_backward(inputs=rows, task="embedding")
    batch = embedding_batch(rows, model.tokenizer.pad_token_id)
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    hf = ref(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    aux = hf.aux_loss.detach()
    torch.testing.assert_close(torch.tensor(out.get("aux_loss")), aux, **_tolerances(aux))


def test_an_empty_share_adds_no_aux(moe_dir):
    """A rank's empty share of a short last batch runs one pad token (every rank joins the
    collectives): it weighs nothing, neither token loss nor aux."""
    model = TransformersModel(str(moe_dir), dtype=torch.float32)
    empty = {k: v[:0] for k, v in _batch().items()}
    out = model.forward_backward(inputs=empty)
    assert out.get("num_tokens") == 0 and "aux_loss" not in out
    for name, param in model.model.named_parameters():
        assert param.grad is None or not param.grad.any(), name
