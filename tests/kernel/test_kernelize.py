"""``kernelize`` on a tiny Llama: instance patching, idempotence, fall-through, errors, logging."""

import copy
import importlib
import logging

import peft
import pytest
import torch
from tolerances import chain_tolerances, tiny_llama_sums

from twinkle.kernel import (
    BACKENDS,
    DEFAULT_KERNEL_CONFIG,
    KernelChoice,
    kernelize,
    register_op,
    registered_ops,
)
from twinkle.kernel import registry as registry_module
from twinkle.kernel.backends.torch_ops import _rms_norm_forward
from twinkle.utils.errors import UserError

N_NORMS, N_MLPS = 5, 2  # 2 layers x (input, post-attention) + the final norm; one MLP per layer


def _modules(model: torch.nn.Module, class_name: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == class_name]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _assert_same_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernels sum the same terms in other orders: within the tiny Llama's forward chain of
    fp32 sums (tolerances.py, ~1e-4 of the logits' scale); a norm that ignores its weight moves
    them by ~1e-1 of it."""
    torch.testing.assert_close(ours, expected, **chain_tolerances(tiny_llama_sums(11), expected))


@pytest.fixture
def twinkle_log(caplog):
    """The 'twinkle' logger does not propagate to the root, where caplog listens: attach to it."""
    logger = logging.getLogger("twinkle")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="twinkle")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry, so a test may register ops without leaking them to others (their
    availability, asked once per process, included)."""
    scratch = {op: dict(impls) for op, impls in registry_module._REGISTRY.items()}
    monkeypatch.setattr(registry_module, "_REGISTRY", scratch)
    monkeypatch.setattr(registry_module, "_available", dict(registry_module._available))
    return scratch


def _records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinkle" and r.levelno == level]


# ---- patching -----------------------------------------------------------------------------------


def test_torch_mapping_patches_instances_and_keeps_logits(tiny_llama, torch_mapping):
    original = tiny_llama()
    model = kernelize(copy.deepcopy(original), torch_mapping)

    norms, mlps = _modules(model, "LlamaRMSNorm"), _modules(model, "LlamaMLP")
    assert len(norms) == N_NORMS and len(mlps) == N_MLPS
    assert all(m._twinkle_kernel == ("rms_norm", "torch") for m in norms)
    assert all(m._twinkle_kernel == ("swiglu_mlp", "torch") for m in mlps)
    assert all(m.forward.__self__ is m for m in norms + mlps)  # bound to its own instance
    _assert_same_logits(_logits(model), _logits(original))


def test_second_call_changes_nothing(twinkle_log, tiny_llama, torch_mapping):
    model = kernelize(tiny_llama(), torch_mapping)
    forwards = {id(m): m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
    before = _logits(model)
    twinkle_log.clear()

    assert kernelize(model, torch_mapping) is model
    assert {id(m): m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__} == forwards
    assert len(forwards) == N_NORMS + N_MLPS
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)
    assert _records(twinkle_log, logging.INFO) == [
        f"kernelize: all {N_NORMS + N_MLPS} mapped modules were already patched; model unchanged"
    ]


def test_other_instances_of_the_class_are_not_patched(tiny_llama, torch_mapping):
    kernelize(tiny_llama(), torch_mapping)
    other = tiny_llama()
    for module in _modules(other, "LlamaRMSNorm") + _modules(other, "LlamaMLP"):
        assert "forward" not in module.__dict__
        assert not hasattr(module, "_twinkle_kernel")
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    assert llama.LlamaRMSNorm.forward.__qualname__ == "LlamaRMSNorm.forward"  # no class-level patch
    assert llama.LlamaMLP.forward.__qualname__ == "LlamaMLP.forward"


def test_deep_copy_reads_its_own_weights(tiny_llama, torch_mapping):
    """A patched forward is bound to its module, so a copy's forward uses the copy's weights."""
    model = kernelize(tiny_llama(), torch_mapping)
    clone = copy.deepcopy(model)
    for module in _modules(clone, "LlamaRMSNorm") + _modules(clone, "LlamaMLP"):
        assert module.forward.__self__ is module
    with torch.no_grad():
        clone.model.norm.weight.mul_(2.0)
    assert not torch.allclose(_logits(clone), _logits(model))


def test_default_config_on_cpu_takes_the_torch_backend(twinkle_log, tiny_llama):
    """On CPU the default chains end in 'torch': RMSNorm (faster), the MLP (one node) and the
    attention's LoRA projections (faster)."""
    model = kernelize(tiny_llama())
    attention = _modules(model, "LlamaAttention")
    assert attention and all(m._twinkle_kernel == ("lora_attention", "torch") for m in attention)
    assert all(m._twinkle_kernel == ("rms_norm", "torch") for m in _modules(model, "LlamaRMSNorm"))
    mlps = _modules(model, "LlamaMLP")
    assert mlps and all(m._twinkle_kernel == ("swiglu_mlp", "torch") for m in mlps)
    assert _records(twinkle_log, logging.INFO) == [
        f"kernelize: {len(attention)} x LlamaAttention -> lora_attention [torch]",
        f"kernelize: {len(mlps)} x LlamaMLP -> swiglu_mlp [torch]",
        f"kernelize: {N_NORMS} x LlamaRMSNorm -> rms_norm [torch]",
    ]


def test_lora_after_kernelize_trains_the_adapters(tiny_llama, torch_mapping):
    """LoRA wraps the MLP's projections after kernelize; the patched forward calls the wrappers."""
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    base = peft.get_peft_model(tiny_llama(), lora)
    ours = peft.get_peft_model(kernelize(tiny_llama(), torch_mapping), lora)
    input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    for model in (base, ours):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    grads = [{n: p.grad for n, p in model.named_parameters() if p.requires_grad} for model in (base, ours)]
    assert (
        grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 3 * 2
    )  # A, B x 3 projections x 2 layers
    for name, grad in grads[0].items():
        # the tiny Llama's chain of fp32 sums in other orders (tolerances.py)
        torch.testing.assert_close(
            grads[1][name], grad, **chain_tolerances(tiny_llama_sums(9), grad), msg=name
        )


def test_swiglu_refuses_another_activation(twinkle_log, tiny_llama):
    """A gelu MLP is not SwiGLU: the patch refuses, the module keeps its forward, one warning."""
    original = tiny_llama(hidden_act="gelu")
    model = kernelize(copy.deepcopy(original), {"LlamaMLP": KernelChoice("swiglu_mlp", ("torch",))})
    assert all("forward" not in m.__dict__ for m in _modules(model, "LlamaMLP"))
    [warning] = _records(twinkle_log, logging.WARNING)
    assert "swiglu_mlp [torch] failed for 2 x LlamaMLP" in warning and "not SiLU" in warning
    torch.testing.assert_close(_logits(model), _logits(original), atol=0, rtol=0)


# ---- user mappings and the registry -------------------------------------------------------------


def test_unknown_op_lists_valid_ops(tiny_llama):
    with pytest.raises(UserError, match="unknown op 'rmsnorm'") as info:
        kernelize(tiny_llama(), {"LlamaRMSNorm": KernelChoice("rmsnorm", ("torch",))})
    for op in registered_ops():
        assert op in str(info.value)


def test_unknown_backend_lists_valid_backends(tiny_llama):
    model = tiny_llama()
    with pytest.raises(UserError, match="unknown backend 'triton'") as info:
        kernelize(model, {"LlamaRMSNorm": KernelChoice("rms_norm", ("triton", "torch"))})
    assert ", ".join(BACKENDS) in str(info.value)
    assert all("forward" not in m.__dict__ for m in model.modules())  # validated before any patch


def test_unavailable_backend_falls_through(scratch_registry, tiny_llama):
    def never_called(module):
        raise AssertionError("patch of an unavailable backend was called")

    register_op("probe_norm", "liger", lambda: False, never_called)
    register_op("probe_norm", "npu", lambda: True, lambda m: _rms_norm_forward.__get__(m))
    model = kernelize(tiny_llama(), {"LlamaRMSNorm": KernelChoice("probe_norm", ("liger", "npu", "torch"))})
    assert all(m._twinkle_kernel == ("probe_norm", "npu") for m in _modules(model, "LlamaRMSNorm"))


def test_a_failing_probe_falls_through_with_one_warning_once_per_process(
    scratch_registry, twinkle_log, tiny_llama
):
    """As a Triton kernel on a GPU machine without a C compiler: importable, but its first call
    fails. The probe's failure, not the user's first forward, picks the next backend."""
    probes = []

    def failing_probe():
        probes.append(1)
        raise RuntimeError("Failed to find C compiler")

    register_op("probe_norm", "liger", lambda: True, lambda m: _rms_norm_forward.__get__(m), failing_probe)
    register_op("probe_norm", "torch", lambda: True, lambda m: _rms_norm_forward.__get__(m))
    mapping = {"LlamaRMSNorm": KernelChoice("probe_norm", ("liger", "torch"))}
    model = kernelize(tiny_llama(), mapping)
    assert all(m._twinkle_kernel == ("probe_norm", "torch") for m in _modules(model, "LlamaRMSNorm"))
    kernelize(tiny_llama(), mapping)
    assert probes == [1]  # once per process
    [warning] = _records(twinkle_log, logging.WARNING)
    assert "probe_norm [liger] failed its probe call (RuntimeError: Failed to find C compiler)" in warning


def test_failing_patch_falls_through_with_one_warning(scratch_registry, twinkle_log, tiny_llama):
    def broken(module):
        raise RuntimeError("kernel library failed to load")

    register_op("probe_norm", "liger", lambda: True, broken)
    register_op("probe_norm", "torch", lambda: True, lambda m: _rms_norm_forward.__get__(m))
    original = tiny_llama()
    model = kernelize(
        copy.deepcopy(original), {"LlamaRMSNorm": KernelChoice("probe_norm", ("liger", "torch"))}
    )

    assert all(m._twinkle_kernel == ("probe_norm", "torch") for m in _modules(model, "LlamaRMSNorm"))
    [warning] = _records(twinkle_log, logging.WARNING)  # one for the 5 instances, not five
    assert warning == (
        f"kernelize: probe_norm [liger] failed for {N_NORMS} x LlamaRMSNorm "
        "(RuntimeError: kernel library failed to load); fell through"
    )
    _assert_same_logits(_logits(model), _logits(original))


def test_nothing_available_leaves_the_model_unchanged(scratch_registry, twinkle_log, tiny_llama):
    register_op("probe_norm", "liger", lambda: False, lambda m: None)
    register_op("probe_norm", "npu", lambda: False, lambda m: None)
    original = tiny_llama()
    model = kernelize(
        copy.deepcopy(original), {"LlamaRMSNorm": KernelChoice("probe_norm", ("liger", "npu", "torch"))}
    )

    assert all("forward" not in m.__dict__ and not hasattr(m, "_twinkle_kernel") for m in model.modules())
    torch.testing.assert_close(_logits(model), _logits(original), atol=0, rtol=0)
    assert _records(twinkle_log, logging.WARNING) == []
    assert _records(twinkle_log, logging.INFO) == [
        "kernelize: no kernel backend is available here for LlamaRMSNorm; model unchanged"
    ]


def test_register_op_rejects_duplicates_and_unknown_backends(scratch_registry):
    with pytest.raises(ValueError, match="'rms_norm' already has a 'torch' implementation"):
        register_op("rms_norm", "torch", lambda: True, lambda m: None)
    with pytest.raises(ValueError, match="unknown backend 'cuda'; valid backends: liger, npu, torch"):
        register_op("probe_norm", "cuda", lambda: True, lambda m: None)
    assert "probe_norm" not in registered_ops()


def test_default_config_names_real_classes_and_registered_ops():
    """Every target is a class of a Hugging Face modeling module, and every op is registered."""
    families = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "qwen3_5", "qwen3_5_moe"]
    families += ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]  # their language models (and Qwen2.5-VL's tower)
    classes = set()
    for family in families:
        classes |= set(vars(importlib.import_module(f"transformers.models.{family}.modeling_{family}")))
    assert set(DEFAULT_KERNEL_CONFIG) <= classes, set(DEFAULT_KERNEL_CONFIG) - classes
    for target, choice in DEFAULT_KERNEL_CONFIG.items():
        registry_module.validate_choice(target, choice)
    zero_centered = {t for t, c in DEFAULT_KERNEL_CONFIG.items() if c.op == "rms_norm_zero_centered"}
    assert zero_centered == {"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"}
