"""What expert parallelism refuses, in one line each, without starting any process: a dense
model, an expert count ``ep_size`` does not divide, a family it does not run, Ulysses beside it
(routing replay beside it runs: ``test_ep_replay.py``), upstream's ``expert_parallel`` options
it cannot honour, a ``--ep-size`` the mesh left out, and the experts' own weights set to train
(LoRA on them trains). The mesh plans ``ep_size`` for the model to run; the switch and the mesh
agree or one of them is said once. (Two ranks: ``test_expert_parallel.py``.)"""

import json
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, Qwen3_5MoeConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
        check_folder(str(tmp_path), None, 2, False, 1)
    assert "ep_size=2 does not divide the model's 7 experts" in _one_line(info)
    check_folder(str(tmp_path), None, 1, False, 1)  # ep_size 1: nothing to check
    check_folder("some/hub-id", None, 2, False, 1)  # checked once loaded


def test_ulysses_beside_it_is_one_line_and_replay_runs():
    with pytest.raises(UserError) as info:
        check_folder("some/hub-id", _qwen3_moe(), 2, False, 2)
    assert "ulysses_size=2 with ep_size=2: Ulysses sequence parallelism is not combined" in _one_line(info)
    check_folder("some/hub-id", _qwen3_moe(), 2, True, 1)  # routing replay beside it: no error


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


def test_expert_weights_that_would_train_are_one_line():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_qwen3_moe())  # full-parameter: every weight trains
    ep = ExpertParallel(type("G", (), {"size": 2, "rank": 0})(), [], 8, torch.device("cpu"))
    with pytest.raises(UserError) as info:
        ep.check_trainable(model)
    assert "ep_size=2: the experts' own weights do not train under expert parallelism" in _one_line(info)
    # LoRA on the experts trains their LoRA weights, the experts' own stay frozen
    lora = LoraConfig(
        r=2,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    ep.check_trainable(get_peft_model(model, lora))
