"""``MegatronModel`` / ``MultiLoraMegatronModel`` with upstream's constructors: at tensor and
pipeline size 1 their calls run on the Transformers models (the same step as
``TransformersModel``'s, bit for bit, under one seed); a size above 1, or a Megatron keyword that
cannot be honoured, is one line. A parallel size on the command line that no model here runs is
refused by the model."""

import pytest
import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.cli import CLI
from twinkle.model import MegatronModel, MultiLoraMegatronModel, TransformersModel
from twinkle.model import megatron as megatron_package
from twinkle.utils.errors import UserError

ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Twinkle."},
        ]
    },
    {"messages": [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "Twinkle"}]},
]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _two_steps(model, adapter, config=LORA):
    torch.manual_seed(0)
    model.add_adapter_to_model(adapter, config, gradient_accumulation_steps=1)
    model.set_optimizer("default", lr=1e-2, weight_decay=0.01, adapter_name=adapter)
    model.set_lr_scheduler("default", lr_decay_steps=4, max_lr=1e-2, adapter_name=adapter)
    losses = []
    for _ in range(2):
        losses.append(float(model.forward_backward(inputs=ROWS, adapter_name=adapter)))
        model.clip_grad_and_step(adapter_name=adapter)
    return losses


def test_megatron_model_runs_the_transformers_step(tiny_model_dir):
    assert megatron_package.MegatronModel is MegatronModel
    megatron = MegatronModel(model_id=str(tiny_model_dir), mixed_precision="no", variable_seq_lengths=True)
    plain = TransformersModel(model_id=str(tiny_model_dir), mixed_precision="no")
    assert isinstance(megatron, TransformersModel)
    assert _two_steps(megatron, "default") == _two_steps(plain, "default")


def test_multi_lora_megatron_model_trains_an_adapter(tiny_model_dir):
    model = MultiLoraMegatronModel(model_id=str(tiny_model_dir), max_loras=2, max_r=4, mixed_precision="no")
    losses = _two_steps(model, "a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert losses[1] < losses[0]


@pytest.mark.parametrize(
    ("keywords", "needle"),
    [
        ({"device_mesh": DeviceMesh.from_sizes(world_size=2, tp_size=2)}, r"tp_size=2\) needs Megatron-Core"),
        ({"device_mesh": DeviceMesh.from_sizes(world_size=2, pp_size=2)}, r"pp_size=2\) needs Megatron-Core"),
        ({"variable_seq_lengths": False}, "variable_seq_lengths is not supported"),
        ({"ddp_config": {"overlap_grad_reduce": True}}, "ddp_config is not supported"),
        ({"recompute_granularity": "selective"}, "recompute_granularity='selective'"),
    ],
)
def test_what_cannot_run_here_is_one_line(tiny_model_dir, keywords, needle):
    with pytest.raises(UserError, match=needle) as info:
        MegatronModel(model_id=str(tiny_model_dir), **keywords)
    assert "\n" not in str(info.value)


def test_a_parallel_size_on_the_command_line_is_refused_by_the_model(tiny_model_dir):
    CLI.from_args(["--ulysses-size", "2"], env={})
    twinkle.initialize()
    with pytest.raises(
        UserError, match="--ulysses-size 2: the mesh TransformersModel runs has ulysses_size=1"
    ):
        TransformersModel(model_id=str(tiny_model_dir))


def test_megatron_optimizer_keywords(tiny_model_dir):
    model = MegatronModel(model_id=str(tiny_model_dir), mixed_precision="no")
    model.add_adapter_to_model("default", LORA)
    model.set_optimizer("Adam", lr=1e-3)  # upstream's Megatron optimizer: Adam with decoupled decay
    inner = model.optimizer_group["default"].optimizer.optimizer
    assert isinstance(inner, torch.optim.AdamW) and inner.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(UserError, match="overlap_param_gather=True is not supported"):
        model.set_optimizer("default", lr=1e-3, overlap_param_gather=True)
    with pytest.raises(UserError, match="min_lr belongs to the schedule"):
        model.set_optimizer("default", lr=1e-3, min_lr=1e-5)


def test_a_model_without_an_adapter_refuses_full_parameter_training_in_one_line(tiny_model_dir):
    # upstream's dpo_full.py: set_optimizer on a model it never gave an adapter
    model = MegatronModel(model_id=str(tiny_model_dir), mixed_precision="no")
    with pytest.raises(
        UserError, match="MegatronModel has no adapter: full-parameter training is not supported yet"
    ):
        model.set_optimizer("default", lr=1e-5, weight_decay=0.01)


def test_save_merge_lora_writes_the_merged_model_beside_the_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = MegatronModel(model_id=str(tiny_model_dir), mixed_precision="no")
    _two_steps(model, "default")
    path = model.save("last", output_dir=str(tmp_path), merge_lora=True)
    assert (path / "adapter_model.safetensors").is_file()  # the checkpoint still resumes
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "last-merged").float()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()
    lora = model.model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (lora.lora_B["default"].weight @ lora.lora_A["default"].weight) * lora.scaling["default"]
    want = base.model.layers[0].self_attn.q_proj.weight + delta.detach().float()
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, want, atol=1e-5, rtol=0)
