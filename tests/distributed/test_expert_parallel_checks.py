"""What expert parallelism refuses, in one line each, without starting any process: a dense
model, an expert count ``ep_size`` does not divide, a family it does not run, upstream's
``expert_parallel`` options it cannot honour, a ``--ep-size`` the mesh left out, and the experts'
own weights set to train (LoRA on them trains). Ulysses and routing replay beside it run
(``test_ep_ulysses.py``, ``test_ep_replay.py``). The mesh plans ``ep_size`` for the model to
run; the switch and the mesh agree or one of them is said once. (Two ranks:
``test_expert_parallel.py``.)"""

import json
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen3_5MoeConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from twinkle import DeviceMesh
from twinkle.distributed.mesh import refuse_unimplemented
from twinkle.model.expert_parallel import ExpertParallel, check_folder, check_model, resolve_options
from twinkle.model.parallel_sizes import refuse_cli_sizes
from twinkle.utils.errors import UserError

MOE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


def _qwen3_moe(experts: int = 8) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**MOE, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16)


def test_the_model_runs_what_the_mesh_plans():
    mesh = DeviceMesh.from_sizes(world_size=2, fsdp_size=2, ep_size=2)
    refuse_unimplemented(mesh, "TransformersModel", runs=("ulysses", "ep"))
    with pytest.raises(UserError, match="ep_size=2 \\(expert parallelism\\)"):
        refuse_unimplemented(mesh, "TorchSampler")
    args = {"infra": {"ep_size": 2}}
    refuse_cli_sizes(args, "TransformersModel", {"ulysses_size": 1, "ep_size": 2})
    with pytest.raises(UserError, match="--ep-size 2: the mesh TransformersModel runs has ep_size=1") as info:
        refuse_cli_sizes(args, "TransformersModel", {"ulysses_size": 1, "ep_size": 1})
    assert "ep_size=args.infra.ep_size" in _one_line(info)


@pytest.mark.parametrize(
    ("config", "size", "needle"),
    [
        (LlamaConfig(**MOE), 2, "ep_size=2: llama is a dense model (no experts to split)"),
        (_qwen3_moe(6), 4, "ep_size=4 does not divide the model's 6 experts"),
    ],
)
def test_a_model_it_cannot_split_is_one_line(config, size, needle):
    with pytest.raises(UserError) as info:
        check_model(config, size)
    assert needle in _one_line(info)


def test_the_families_it_runs():
    check_model(_qwen3_moe(), 2)
    check_model(_qwen3_moe(), 8)
    check_model(GptOssConfig(**MOE, num_local_experts=8), 2)  # its biases go with the blocks
    with pytest.raises(UserError) as info:
        check_model(MixtralConfig(**MOE, num_local_experts=8), 2)
    text = _one_line(info)
    assert text.startswith("ep_size=2 runs the families") and "mixtral is not one of them" in text
    text = Qwen3_5MoeConfig(text_config={**MOE, "num_experts": 4, "moe_intermediate_size": 16})
    check_model(text, 2)  # the composite config: its text model's experts
    with pytest.raises(UserError) as info:
        check_model(text, 8)
    assert "does not divide the model's 4 experts" in _one_line(info)


def test_a_folder_is_checked_before_its_weights_load(tmp_path):
    config = _qwen3_moe(8).to_dict()  # saved as transformers saves it: num_local_experts
    config.pop("num_experts", None)
    config["num_local_experts"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as info:
        check_folder(str(tmp_path), None, 2)
    assert "ep_size=2 does not divide the model's 7 experts" in _one_line(info)
    check_folder(str(tmp_path), None, 1)  # ep_size 1: nothing to check
    check_folder("some/hub-id", None, 2)  # checked once loaded


def test_ulysses_and_replay_beside_it_run():
    check_folder("some/hub-id", _qwen3_moe(), 2)  # its check reads neither: no error
    refuse_unimplemented(
        DeviceMesh.from_sizes(world_size=2, ulysses_size=2, ep_size=2),
        "TransformersModel",
        runs=("ulysses", "ep"),
    )


def test_upstreams_switch_and_options(caplog):
    assert resolve_options(None, 2) and not resolve_options(None, 1)
    on = {"expert_parallel": {"enabled": True, "router_dtype": "fp32", "keep_router_logits": False}}
    assert resolve_options(on, 2)
    assert resolve_options({"expert_parallel": True}, 2)
    with caplog.at_level(logging.WARNING):
        assert not resolve_options(on, 1)  # nothing to split: said once
        assert not resolve_options({"expert_parallel": {"enabled": False}}, 2)  # FSDP2 shards the experts
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "ep_size=1" in said[0] and "is disabled" in said[1]
    for value, needle in [
        ({"router_dtype": "bf16"}, "['router_dtype']='bf16': the router here is the model's own"),
        ({"ep_size": 4}, "['ep_size']=4 but the mesh has ep_size=2"),
        ({"capacity_factor": 1.0}, "keys ['capacity_factor'] are not supported here"),
        ("yes", "must be a dict of options"),
    ]:
        with pytest.raises(UserError) as info:
            resolve_options({"expert_parallel": value}, 2)
        assert needle in _one_line(info)


def test_expert_weights_train_without_adapters_and_not_beside_one():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_qwen3_moe())
    ep = ExpertParallel(type("G", (), {"size": 2, "rank": 0})(), [], 8, torch.device("cpu"))
    # full-parameter: every weight trains, each rank its block of the experts
    ep.check_trainable(model)
    # LoRA on the experts trains their LoRA weights, the experts' own stay frozen
    lora = LoraConfig(
        r=2,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, lora)
    ep.check_trainable(peft_model)
    # an expert's own weight set to train beside its LoRA: the adapter's optimizer keeps whole copies
    names = dict(peft_model.named_parameters())
    base = names["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"]
    base.requires_grad_(True)
    with pytest.raises(UserError) as info:
        ep.check_trainable(peft_model)
    assert "would train beside a LoRA adapter" in _one_line(info)
