"""Adapter slots on a mixture-of-experts model's fused experts, in one process.

Two adapters trained interleaved on one ``MultiLoraTransformersModel`` end as each trained alone
on a plain ``TransformersModel`` (PEFT's own LoRA, started from the same initial weights): the
same losses and saved adapters up to the order of fp32 sums (a slot of rank ``max_r`` sums its
unused ranks' exact zeros in its products; ``tolerances.run_loss_rtol``, ``adamw_weight_atol``).
On tiny random checkpoints: Qwen3-MoE, where PEFT maps ``all-linear`` onto the fused experts
(``gate_up_proj`` at twice the rank) and the router, with the slots' default config; and
DeepSeek-V4 in upstream's cookbook shape (``lora_config`` without ``target_parameters``, each
adapter adding them, so the first one attaches the expert slots before the model is placed).
Each saved adapter loads in plain PEFT with the weights saved. ``lora_config`` keys the slots
cannot honour are one line each."""

import json

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from tolerances import adamw_weight_atol, chain_tolerances, llama_sums, run_loss_rtol

from twinkle.model import MultiLoraTransformersModel, TransformersModel
from twinkle.utils.errors import UserError

STEPS, LR = 3, 1e-2
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROWS = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Twinkle, a model."}]},
    {"messages": [{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "France, my friend"}]},
]  # fmt: skip


def _ids(tiny_model_dir) -> dict:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return {k: config.get(k) for k in ("vocab_size", "eos_token_id", "pad_token_id")}


def _save(model, tiny_model_dir, out):
    model.save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            (out / path.name).write_bytes(path.read_bytes())
    return out


@pytest.fixture(scope="module")
def qwen3_moe(tiny_model_dir, tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        **_ids(tiny_model_dir), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
        norm_topk_prob=True, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return _save(
        transformers.Qwen3MoeForCausalLM(config), tiny_model_dir, tmp_path_factory.mktemp("qwen3-moe")
    )


@pytest.fixture(scope="module")
def deepseek_v4(tiny_model_dir, tmp_path_factory):
    """3 layers (hash-routed, then top-2 of 8 experts), as tests/distributed/test_ep_deepseek_v4.py."""
    config = transformers.DeepseekV4Config(
        **_ids(tiny_model_dir), hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, qk_rope_head_dim=4,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, swiglu_limit=0.5,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
        index_topk=64, sliding_window=16, hc_mult=2, max_position_embeddings=512, num_nextn_predict_layers=0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config)
    with torch.no_grad():
        table = torch.rand(config.vocab_size, 8).argsort(dim=1)[:, :2]
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    return _save(model, tiny_model_dir, tmp_path_factory.mktemp("deepseek-v4"))


def train(model, names, steps=STEPS) -> dict[str, list[float]]:
    losses = {n: [] for n in names}
    for _ in range(steps):
        for name in names:
            model.forward_backward(inputs=ROWS, adapter_name=name)
            model.clip_grad_and_step(adapter_name=name)
            losses[name].append(model.calculate_metric(is_training=True, adapter_name=name)["loss"])
    return losses


def alone(model_dir, config, start) -> tuple[list[float], dict]:
    """``config`` trained alone from the slot's initial weights (the folder ``start``)."""
    model = TransformersModel(model_id=str(model_dir))
    model.add_adapter_to_model("default", config)
    model.load(str(start))
    model.set_optimizer("AdamW", lr=LR)
    return train(model, ["default"])["default"], model.get_state_dict()


def compare(model_dir, specs, tmp_path, **slot_kwargs) -> dict:
    """``specs`` (name -> LoraConfig kwargs) trained interleaved on slots, then each alone."""
    multi = MultiLoraTransformersModel(str(model_dir), max_loras=2, max_r=8, **slot_kwargs)
    for name, spec in specs.items():
        multi.add_adapter_to_model(name, LoraConfig(**spec))
    start = {name: multi.save(f"init-{name}", output_dir=str(tmp_path), adapter_name=name) for name in specs}
    for name in specs:
        multi.set_optimizer("AdamW", lr=LR, adapter_name=name)
    losses = train(multi, list(specs))
    rtol, atol = run_loss_rtol(len(ROWS), 64), adamw_weight_atol(LR, STEPS)
    saved = {}
    for name, spec in specs.items():
        solo_losses, solo = alone(model_dir, LoraConfig(**spec), start[name])
        assert losses[name][-1] < losses[name][0]  # it trained
        for a, b in zip(losses[name], solo_losses, strict=True):
            assert abs(a - b) <= rtol * max(1.0, abs(b)), (name, losses[name], solo_losses)
        folder = multi.save(f"final-{name}", output_dir=str(tmp_path), adapter_name=name)
        saved[name] = load_file(str(folder / "adapter_model.safetensors"))
        assert saved[name].keys() == solo.keys(), (name, sorted(set(saved[name]) ^ set(solo)))
        for key, weight in solo.items():
            assert saved[name][key].shape == weight.shape, key
            assert (saved[name][key] - weight).abs().max() <= atol, key
        initial = load_file(str(start[name] / "adapter_model.safetensors"))
        assert any((saved[name][k] - initial[k]).abs().max() > LR for k in saved[name] if ".experts." in k)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, str(folder)))
        assert loaded.keys() == saved[name].keys()
        assert all(torch.equal(loaded[k], saved[name][k]) for k in loaded)
    return saved


def test_qwen3_moe_slots_on_experts_equal_plain_adapters(qwen3_moe, tmp_path):
    saved = compare(
        qwen3_moe,
        {
            "a": dict(
                r=4, lora_alpha=8, target_modules="all-linear"
            ),  # PEFT: experts at rank 8, and the router
            "b": dict(
                r=2, lora_alpha=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]
            ),
        },
        tmp_path,
    )
    a_experts = {k: v.shape for k, v in saved["a"].items() if ".experts." in k and "lora_A" in k}
    assert {s[0] for s in a_experts.values()} == {8 * 8, 4 * 8}  # gate_up at rank 8, down_proj at 4
    assert any(".mlp.gate." in k for k in saved["a"])  # the router's weight
    # b's only expert parameter is the module itself in its own file (the slots nest two wrappers)
    assert sorted(k for k in saved["b"] if ".experts." in k)[0].endswith("layers.0.mlp.experts.lora_A.weight")


def test_deepseek_v4_upstream_shape_attaches_expert_slots_on_the_first_adapter(deepseek_v4, tmp_path):
    slots = LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", exclude_modules=["o_a_proj"])
    experts = dict(target_modules="all-linear", exclude_modules=["o_a_proj"], target_parameters=EXPERTS)
    saved = compare(
        deepseek_v4,
        {"tenant_a": dict(r=4, lora_alpha=8, **experts), "tenant_b": dict(r=8, lora_alpha=32, **experts)},
        tmp_path,
        lora_config=slots,
    )
    assert not any("o_a_proj" in k for k in saved["tenant_a"])
    assert (
        sum(".experts." in k for k in saved["tenant_a"]) == 2 * 2 * 3
    )  # 3 MoE layers, 2 parameters, A and B


def test_a_mixed_batch_over_expert_slots_runs_each_row_through_its_adapter(qwen3_moe):
    """``forward_only(adapter_names=[...])`` over expert slots (all-linear: PEFT reaches the
    experts) runs: an adapter whose LoRA B is still zero leaves its row at the base's
    log-probabilities (tests/model/test_mixed_eval_expert_slots.py compares trained adapters)."""
    model = MultiLoraTransformersModel(str(qwen3_moe), max_loras=2, max_r=8)
    model.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["q_proj"]))
    mixed = model.forward_only(inputs=ROWS, adapter_names=["a", None])["logps"]
    base = model.forward_only(inputs=ROWS, adapter_name="a", disable_lora=True)["logps"]
    assert mixed.shape == base.shape and bool((mixed != 0).any())
    # padded here, perhaps packed there: fp32 sums in other orders, each layer's top-2 experts besides
    sums = llama_sums(32, 16, 2, base.shape[1], 600) + [2, 2]
    torch.testing.assert_close(mixed, base, **chain_tolerances(sums, base))


def test_target_parameters_on_a_dense_model_are_one_line(tiny_model_dir):
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=1, max_r=4)
    with pytest.raises(UserError, match="has no such parameter") as info:
        model.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERTS))
    assert "\n" not in str(info.value)


def test_expert_slots_after_placement_are_one_line(deepseek_v4):
    model = MultiLoraTransformersModel(str(deepseek_v4), max_loras=2, max_r=8)
    model.add_adapter_to_model("plain", LoraConfig(r=4, target_modules=["q_b_proj"]))
    model.set_optimizer("AdamW", adapter_name="plain")  # the first per-adapter call places the model
    with pytest.raises(UserError, match="placed") as info:
        model.add_adapter_to_model("experts", LoraConfig(r=4, target_modules=[], target_parameters=EXPERTS))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("lora_config", "message"),
    [
        (LoraConfig(use_dora=True), "use_dora"),
        (LoraConfig(bias="all", modules_to_save=["lm_head"]), "bias, modules_to_save"),
        ({"target_modules": ["q_proj"], "rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"no_such_key": 1}, "no_such_key"),
        ("all-linear", "peft.LoraConfig or a dict"),
    ],
)
def test_lora_config_keys_the_slots_cannot_honour_are_one_line(tiny_model_dir, lora_config, message):
    with pytest.raises(UserError, match=message) as info:
        MultiLoraTransformersModel(str(tiny_model_dir), max_loras=1, max_r=4, lora_config=lora_config)
    assert "\n" not in str(info.value)


def test_lora_config_places_the_slots(tiny_model_dir, caplog):
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=1, max_r=4, lora_config=config)
    assert {k.rsplit(".", 1)[-1] for k in model.slots.layers} == {"q_proj", "v_proj"}
    assert "r=16, lora_alpha=32 not used" in caplog.text
    with pytest.raises(UserError, match="outside the slots"):
        model.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["k_proj"]))
    with pytest.raises(UserError, match="name the slots' modules once"):
        MultiLoraTransformersModel(
            str(tiny_model_dir), max_loras=1, target_modules=["k_proj"], lora_config=config
        )
