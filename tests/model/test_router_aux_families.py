"""The MoE router's load-balancing loss (``twinkle.model.router_aux``) on the families beyond
Qwen3-MoE whose transformers forward computes it: gpt-oss, Qwen3.5-MoE (text), Qwen3-Next and
DeepSeek-V4 (its top-k routed layers; the hash-routed ones route no logits to it).

Each is a tiny random checkpoint built here from a config that asks for the aux
(``output_router_logits=True``, a large ``router_aux_loss_coef``). One full-parameter step in one
process on a right-padded batch: twinkle's step loss equals transformers' ``outputs.loss`` with
labels (token mean plus coef * aux), its aux equals ``outputs.aux_loss``, and the gradient of
every router weight (and gpt-oss's router bias) equals transformers' ``loss.backward()``.

Tolerances, as in tests/model/test_router_aux_loss.py: the same terms summed in other orders (the
head apart from the model), so within the first-order bound of the model's chain of sums
(``chain_tolerances`` of ``llama_sums``, plus the aux's sums over the routed tokens and the
experts, and each family's own further sums). Dropping the aux moves a router's gradient by a
sizeable fraction of its scale (checked below), orders beyond the bound."""

import json
import shutil

import pytest
import torch
import transformers
from batches import prefix_batch
from tolerances import chain_tolerances, llama_sums

from twinkle.model import TransformersModel
from twinkle.model.router_aux import router_aux_of

IGNORE, COEF, HIDDEN, MOE, EXPERTS, LAYERS = -100, 0.5, 32, 16, 8, 2
LINEAR = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"], shared_expert_intermediate_size=16,
)  # fmt: skip
QWEN = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE, max_position_embeddings=512,
    norm_topk_prob=True,
)  # fmt: skip
FAMILIES = {
    # config class, its keywords, the router's module (in its parameters' names), and the family's
    # further sums per layer, in the row's tokens: linear attention's state carried over the tokens,
    # forward and backward (2); DeepSeek-V4's compressed keys and its indexer besides (4)
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
            intermediate_size=MOE,
            swiglu_limit=0.5,
            max_position_embeddings=512,
        ),  # fmt: skip
        "mlp.router.",
        0,
    ),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, {**QWEN, **LINEAR}, "mlp.gate.", 2),
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        {**QWEN, **LINEAR, "intermediate_size": 64, "decoder_sparse_step": 1},
        "mlp.gate.",
        2,
    ),
    "deepseek_v4": (
        transformers.DeepseekV4Config,
        dict(
            hidden_size=HIDDEN,
            moe_intermediate_size=MOE,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=2,
            n_shared_experts=1,
            swiglu_limit=0.5,
            o_groups=2,
            o_lora_rank=16,
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            index_n_heads=2,
            index_head_dim=8,
            index_topk=64,
            sliding_window=16,
            hc_mult=2,
            max_position_embeddings=512,
            num_nextn_predict_layers=0,
        ),  # fmt: skip
        "mlp.gate.",
        4,
    ),
}


def _build(name: str, tiny_model_dir, out):
    config_cls, shape, _, _ = FAMILIES[name]
    ids = json.loads((tiny_model_dir / "config.json").read_text())
    ids = {k: ids.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}
    config = config_cls(
        **shape, **ids, output_router_logits=True, router_aux_loss_coef=COEF, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "tid2eid"):  # DeepSeek-V4's hash routing: 2 distinct experts a token
                table = torch.rand(config.vocab_size, EXPERTS).argsort(dim=1)[:, :2]
                module.tid2eid.copy_(table)
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_model_dir, tmp_path_factory):
    return request.param, _build(request.param, tiny_model_dir, tmp_path_factory.mktemp(request.param))


def _batch(lengths: tuple[int, ...] = (11, 5, 14), seed: int = 0) -> dict[str, torch.Tensor]:
    return prefix_batch(lengths, seed)


def _tolerances(name: str, reference: torch.Tensor) -> dict:
    batch = _batch()
    tokens = batch["input_ids"].shape[1]
    layers = FAMILIES[name][1].get("num_hidden_layers", LAYERS)
    extra = [FAMILIES[name][3] * tokens] * layers
    sums = llama_sums(HIDDEN, 64, layers, tokens, 600) + extra + [batch["input_ids"].numel(), 2 * EXPERTS]
    return chain_tolerances(sums, reference)


def _step(folder, **config) -> tuple:
    """One twinkle step on the batch, padded: (its outputs, the model, its gradients made means)."""
    kwargs = {"config": transformers.AutoConfig.from_pretrained(folder, **config)} if config else {}
    model = TransformersModel(str(folder), dtype=torch.float32, padding_free=False, **kwargs)
    out = model.forward_backward(inputs=_batch())
    grads = {
        n: p.grad / out.get("num_tokens") for n, p in model.model.named_parameters() if p.grad is not None
    }
    return out, model, grads


def test_step_loss_aux_and_router_gradients_equal_transformers(family):
    name, folder = family
    router = FAMILIES[name][2]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = ref(**_batch())
    hf.loss.backward()
    out, model, grads = _step(folder)
    assert router_aux_of(model.model) is not None
    assert float(hf.aux_loss.detach()) > 0
    aux = torch.tensor(out.get("aux_loss"))
    torch.testing.assert_close(aux, hf.aux_loss.detach(), **_tolerances(name, hf.aux_loss))
    torch.testing.assert_close(torch.tensor(float(out)), hf.loss.detach(), **_tolerances(name, hf.loss))
    routers = [(n, p) for n, p in ref.named_parameters() if router in n and p.grad is not None]
    assert sum(n.endswith(router + "weight") for n, _ in routers) >= LAYERS, [n for n, _ in routers]
    for n, param in routers:
        torch.testing.assert_close(grads[n], param.grad, **_tolerances(name, param.grad), msg=n)


def test_the_aux_moves_the_router_gradient(family):
    """Without the aux a router's gradient is another one: the check above can fail."""
    name, folder = family
    _, _, without = _step(folder, output_router_logits=False)
    _, _, grads = _step(folder)
    routers = [n for n in grads if n.endswith(FAMILIES[name][2] + "weight")]
    assert routers
    for n in routers:
        scale = grads[n].abs().max()
        assert (grads[n] - without[n]).abs().max() > 0.05 * scale, n
