"""Upstream's ``TransformersModel`` keywords: mapped to ours, or a clear error."""

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from twinkle.distributed import DeviceMesh
from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError


def test_mixed_precision_and_model_cls_and_config(tiny_model_dir):
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.rms_norm_eps = 1e-3
    model = TransformersModel(
        model_id=str(tiny_model_dir), model_cls=LlamaForCausalLM, config=config, mixed_precision="bf16"
    )
    assert type(model.model) is LlamaForCausalLM
    assert next(model.model.parameters()).dtype == torch.bfloat16
    assert model.model.config.rms_norm_eps == 1e-3
    assert (
        next(TransformersModel(str(tiny_model_dir), mixed_precision="no").model.parameters()).dtype
        == torch.float32
    )


def test_fp16_falls_back_to_the_device_default_with_one_warning(tiny_model_dir, caplog):
    from twinkle.model import options
    from twinkle.model.loading import default_dtype
    from twinkle.runtime import get_runtime

    options._warned.clear()
    with caplog.at_level("WARNING"):
        first = TransformersModel(
            str(tiny_model_dir), mixed_precision="fp16", grad_scaler_config={"init_scale": 2}
        )
        second = TransformersModel(str(tiny_model_dir), mixed_precision="fp16")
    device = get_runtime().device
    expected = default_dtype(device)  # bf16 on an accelerator, fp32 on CPU
    warnings = [r.getMessage() for r in caplog.records if "mixed_precision" in r.getMessage()]
    assert warnings == [
        "mixed_precision='fp16' needs a gradient scaler, which is not implemented here; grad_scaler_config= "
        f"is ignored; training in {str(expected).removeprefix('torch.')} on {device.type} instead"
    ]
    assert next(first.model.parameters()).dtype == next(second.model.parameters()).dtype == expected
    assert expected != torch.float16


def test_the_mesh_given_must_be_the_runtimes(tiny_model_dir):
    TransformersModel(str(tiny_model_dir), device_mesh=DeviceMesh(fsdp_size=1, dp_size=1))
    with pytest.raises(
        UserError, match=r"device_mesh= \(2 replica\(s\) x 1 shard\(s\) = 2 ranks\) is not the mesh"
    ):
        TransformersModel(str(tiny_model_dir), device_mesh=DeviceMesh(fsdp_size=1, dp_size=2))


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"strategy": "megatron"}, r"strategy='megatron' is not one of native_fsdp, accelerate"),
        ({"mixed_precision": "fp8"}, r"mixed_precision='fp8' is not supported here; use one of no, bf16"),
        ({"grad_scaler_config": {"init_scale": 2}}, r"grad_scaler_config= is for fp16 training"),
        (
            {"ddp_config": {"bucket_cap_mb": 25}},
            r"ddp_config keys \['bucket_cap_mb'\] are not supported here",
        ),
        ({"strategy": "ddp", "fsdp_config": {"x": 1}}, r"fsdp_config= goes with an FSDP strategy"),
        ({"fsdp_config": {"reshard_after_forward": False}}, r"fsdp_config keys \['reshard_after_forward'\]"),
        ({"model_cls": object}, r"model_cls=<class 'object'> has no from_pretrained"),
    ],
)
def test_what_cannot_be_honoured_is_an_error(tiny_model_dir, keywords, message):
    with pytest.raises(UserError, match=message):
        TransformersModel(str(tiny_model_dir), **keywords)


def test_ddp_config_with_an_honoured_key_selects_ddp(tiny_model_dir):
    model = TransformersModel(str(tiny_model_dir), ddp_config={"find_unused_parameters": True})
    assert model.strategy == "ddp"
    assert TransformersModel(str(tiny_model_dir), strategy="native_fsdp").strategy == "fsdp"


def test_args_reads_flat_by_field_name():
    from twinkle.cli import CLI

    args = CLI.from_args(["--batch-size", "8", "--model-name", "Pip"], env={})
    assert args.get("batch_size") == args["batch_size"] == 8
    assert args["model_name"] == "Pip" and args.get("nope", 3) == 3
    with pytest.raises(KeyError, match="'nope' is neither a field nor an extra key"):
        args["nope"]


def test_ddp_refuses_a_mesh_that_shards_the_model(tiny_model_dir, monkeypatch):
    import dataclasses

    from peft import LoraConfig

    model = TransformersModel(str(tiny_model_dir), strategy="ddp")
    # as on 2 ranks of --fsdp-size 2: the check comes before any process group is needed
    monkeypatch.setattr(
        model, "runtime", dataclasses.replace(model.runtime, mesh=DeviceMesh(fsdp_size=2, dp_size=1))
    )
    with pytest.raises(
        UserError, match=r"strategy='ddp' keeps a whole model on every rank, but the mesh shards it"
    ):
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def test_transformers_hub_kernels_stay_off_so_mode_switches_do_not_re_kernelize(tiny_model_dir, monkeypatch):
    import transformers

    if not hasattr(transformers.PreTrainedModel, "use_kernels"):
        pytest.skip("this transformers has no hub kernels to turn off")
    model = TransformersModel(str(tiny_model_dir))
    base = model.model.get_base_model() if hasattr(model.model, "get_base_model") else model.model
    assert base.use_kernels is False
    calls = []
    monkeypatch.setattr(type(base), "set_use_kernels", lambda self, *a, **k: calls.append(a), raising=True)
    model.model.eval()
    model.model.train()
    assert calls == []  # a switch of mode leaves the layers as twinkle's kernelize set them
