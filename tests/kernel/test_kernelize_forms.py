"""Every key and value form ``kernelize(model, mapping)`` takes, on a tiny Llama built from a
config: outputs against a reference, the errors, idempotence, copies and other models."""

import copy
import importlib
import logging
import sys
import types

import pytest
import torch
from tiny import TINY_LLAMA_SHAPE
from tolerances import chain_tolerances, tiny_llama_sums
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from twinkle.kernel import DEFAULT_KERNEL_CONFIG, HubRef, KernelChoice, hub, kernelize
from twinkle.kernel.kernelize import MARK
from twinkle.utils.errors import UserError

N_NORMS = 5  # 2 layers x (input, post-attention) + the final norm
NORM_PATH = "transformers.models.llama.modeling_llama.LlamaRMSNorm"


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_SHAPE, vocab_size=100))
    for name, param in model.named_parameters():
        if "norm" in name:  # non-trivial weights, so a forward that ignores them is caught
            torch.nn.init.normal_(param, mean=1.0, std=0.2)
    return model.eval()


@pytest.fixture
def llama():
    return _tiny_llama()


@pytest.fixture
def twinkle_log(caplog):
    logger = logging.getLogger("twinkle")  # it does not propagate to the root
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="twinkle")
    yield caplog
    logger.removeHandler(caplog.handler)


def _info(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "twinkle" and r.levelno == logging.INFO]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _assert_same_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """A norm written another way sums the same terms in other orders: within the tiny Llama's
    forward chain of fp32 sums (tolerances.py, ~1e-4 of the logits' scale); a norm that is not
    called, or ignores its weight, moves them by ~1e-1 of it."""
    torch.testing.assert_close(ours, expected, **chain_tolerances(tiny_llama_sums(7), expected))


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m) is LlamaRMSNorm]


def _untouched(model: torch.nn.Module) -> bool:
    return all("forward" not in m.__dict__ and not hasattr(m, MARK) for m in model.modules())


def _path(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


# ---- user values ---------------------------------------------------------------------------------


class SameNorm(torch.nn.Module):
    """Computes what LlamaRMSNorm computes, from the instance's own weight and epsilon. Its
    ``__init__`` must never run: kernelize builds nothing."""

    inits = 0

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        SameNorm.inits += 1
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def doubled(self, hidden_states):
    """A function value: twice what the class computes."""
    return 2 * LlamaRMSNorm.forward(self, hidden_states)


def tripled(self, hidden_states):
    return 3 * LlamaRMSNorm.forward(self, hidden_states)


class CallsSuper(LlamaRMSNorm):
    def forward(self, hidden_states):
        return super().forward(hidden_states) * 2


class NeedsHelper(torch.nn.Module):
    def forward(self, hidden_states):
        return self.scale(hidden_states)

    def scale(self, hidden_states):
        return hidden_states


class NoForward(torch.nn.Module):
    pass


class NotAModule:
    def forward(self, hidden_states):
        return hidden_states


def _norm_input() -> torch.Tensor:
    return torch.randn(2, 5, TINY_LLAMA_SHAPE["hidden_size"], generator=torch.Generator().manual_seed(4))


# ---- keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["LlamaRMSNorm", LlamaRMSNorm, NORM_PATH], ids=["name", "class", "path"])
def test_every_key_form_selects_the_same_modules(llama, key):
    original = copy.deepcopy(llama)
    kernelize(llama, {key: KernelChoice("rms_norm", ("torch",))})
    norms = _norms(llama)
    assert len(norms) == N_NORMS and all(getattr(m, MARK) == ("rms_norm", "torch") for m in norms)
    assert all("forward" not in m.__dict__ for m in llama.modules() if type(m) is not LlamaRMSNorm)
    _assert_same_logits(_logits(llama), _logits(original))


def test_a_class_key_matches_that_class_only_not_subclasses():
    class MyNorm(LlamaRMSNorm):
        pass

    model = torch.nn.Sequential(LlamaRMSNorm(8), MyNorm(8))
    kernelize(model, {LlamaRMSNorm: doubled})
    assert getattr(model[0], MARK)[0] == "custom"
    assert "forward" not in model[1].__dict__ and not hasattr(model[1], MARK)


def test_the_last_matching_key_wins(llama):
    """``{**DEFAULT_KERNEL_CONFIG, LlamaRMSNorm: SameNorm}``: the class key overrides the name."""
    kernelize(llama, {**DEFAULT_KERNEL_CONFIG, LlamaRMSNorm: SameNorm})
    assert all(getattr(m, MARK) == ("custom", _path(SameNorm)) for m in _norms(llama))
    assert all(getattr(m, MARK) == ("swiglu_mlp", "torch") for m in llama.modules() if type(m) is LlamaMLP)


# ---- values --------------------------------------------------------------------------------------


def test_a_module_class_value_binds_its_forward_to_each_instance(twinkle_log, llama):
    original = copy.deepcopy(llama)
    inits = SameNorm.inits
    kernelize(llama, {LlamaRMSNorm: SameNorm})

    norms = _norms(llama)
    assert SameNorm.inits == inits  # nothing was constructed
    for norm in norms:
        assert type(norm) is LlamaRMSNorm  # the instance keeps its class
        assert norm.forward.__self__ is norm and norm.forward.__func__ is SameNorm.forward
        assert getattr(norm, MARK) == ("custom", _path(SameNorm))
    assert LlamaRMSNorm.forward.__qualname__ == "LlamaRMSNorm.forward"  # the class is untouched
    _assert_same_logits(_logits(llama), _logits(original))
    assert _info(twinkle_log) == [f"kernelize: {N_NORMS} x LlamaRMSNorm -> custom [{_path(SameNorm)}]"]


def test_a_function_value_is_bound_and_shows_in_the_output(llama):
    original = copy.deepcopy(llama)
    kernelize(llama, {NORM_PATH: doubled})

    norm, x = llama.model.norm, _norm_input()
    assert norm.forward.__self__ is norm and norm.forward.__func__ is doubled
    assert getattr(norm, MARK) == ("custom", _path(doubled))
    with torch.no_grad():
        torch.testing.assert_close(norm(x), 2 * LlamaRMSNorm.forward(norm, x), atol=0, rtol=0)
        torch.testing.assert_close(norm(x), 2 * original.model.norm(x), atol=0, rtol=0)
    assert not torch.allclose(_logits(llama), _logits(original))


def test_a_users_forward_that_fails_raises(llama):
    def broken(self, hidden_states):
        raise RuntimeError("my kernel is broken")

    kernelize(llama, {"LlamaRMSNorm": broken})
    with pytest.raises(RuntimeError, match="my kernel is broken"):
        _logits(llama)


def test_a_device_dict_takes_the_models_device_entry(llama):
    kernelize(llama, {LlamaRMSNorm: {"cuda": tripled, "cpu": doubled, "npu": "kernels-community/x:Y"}})
    assert all(m.forward.__func__ is doubled for m in _norms(llama))


def test_a_device_dict_without_the_models_device_changes_nothing(twinkle_log, llama):
    original = copy.deepcopy(llama)
    kernelize(llama, {LlamaRMSNorm: {"cuda": doubled}})
    assert _untouched(llama)
    torch.testing.assert_close(_logits(llama), _logits(original), atol=0, rtol=0)
    assert _info(twinkle_log) == [
        "kernelize: no kernel backend is available here for LlamaRMSNorm; model unchanged"
    ]


# ---- hub references ------------------------------------------------------------------------------

LAYERS_PY = """
import torch


class SameNorm(torch.nn.Module):
    has_backward = True

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)
"""


def _fake_kernels(monkeypatch, install) -> list[tuple]:
    """A stand-in ``kernels`` package whose ``install_kernel`` is ``install``; returns its calls."""
    calls = []

    def install_kernel(repo_id, revision, local_files_only=False):
        calls.append((repo_id, revision, local_files_only))
        return install(repo_id, revision)

    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(install_kernel=install_kernel))
    return calls


def test_a_hub_reference_without_the_kernels_package_says_nothing_is_downloaded(monkeypatch, llama):
    monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels -> ImportError
    with pytest.raises(UserError) as info:
        kernelize(llama, {LlamaRMSNorm: "kernels-community/rmsnorm:RMSNorm"})
    message = str(info.value)
    assert "\n" not in message
    assert "kernels-community/rmsnorm:RMSNorm" in message and "'kernels' package" in message
    assert "nothing is downloaded" in message
    assert _untouched(llama)


def test_a_hub_reference_not_in_the_local_cache_raises(monkeypatch, llama):
    def missing(repo_id, revision):
        raise FileNotFoundError(f"{repo_id} at {revision} is not cached\n(more detail)")

    calls = _fake_kernels(monkeypatch, missing)
    with pytest.raises(UserError) as info:
        kernelize(llama, {"LlamaRMSNorm": hub("kernels-community/rmsnorm:RMSNorm", revision="abc123")})
    message = str(info.value)
    assert calls == [("kernels-community/rmsnorm", "abc123", True)]  # asked for local files only
    assert "\n" not in message and "not in the local kernels cache" in message
    assert "kernels-community/rmsnorm:RMSNorm@abc123" in message and "nothing is downloaded" in message
    assert _untouched(llama)


def test_a_cached_hub_layer_is_bound_like_a_module_class(monkeypatch, tmp_path, llama):
    variant = tmp_path / "build" / "torch-universal"
    package = variant / "fake_rmsnorm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import layers\n")
    (package / "layers.py").write_text(LAYERS_PY)
    calls = _fake_kernels(monkeypatch, lambda repo_id, revision: ("fake_rmsnorm", variant))
    original = copy.deepcopy(llama)

    kernelize(llama, {LlamaRMSNorm: "kernels-community/fake-rmsnorm:SameNorm"})
    assert calls == [("kernels-community/fake-rmsnorm", "main", True)]  # loaded once, not per instance
    for norm in _norms(llama):
        assert getattr(norm, MARK) == ("hub", "kernels-community/fake-rmsnorm:SameNorm")
        assert norm.forward.__self__ is norm and norm.forward.__qualname__ == "SameNorm.forward"
    _assert_same_logits(_logits(llama), _logits(original))


def test_a_cached_hub_kernel_that_does_not_import_raises(monkeypatch, tmp_path, llama):
    package = tmp_path / "cuda_only"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('needs CUDA')\n")
    _fake_kernels(monkeypatch, lambda repo_id, revision: ("cuda_only", tmp_path))
    with pytest.raises(UserError, match=r"is cached but does not import here \(ImportError: needs CUDA\)"):
        kernelize(llama, {LlamaRMSNorm: "org/cuda-only:RMSNorm"})
    assert _untouched(llama)


def test_a_cached_hub_kernel_without_the_layer_raises(monkeypatch, tmp_path, llama):
    package = tmp_path / "empty_kernel"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _fake_kernels(monkeypatch, lambda repo_id, revision: ("empty_kernel", tmp_path))
    with pytest.raises(UserError, match="has no layer 'RMSNorm'"):
        kernelize(llama, {LlamaRMSNorm: HubRef("org/empty", "RMSNorm", revision="main")})
    assert _untouched(llama)


def test_hub_builds_a_reference():
    assert hub("org/repo:Layer", version=2) == HubRef("org/repo", "Layer", None, 2)
    with pytest.raises(UserError, match="expected 'owner/repo:LayerName'"):
        hub("org/repo")
    with pytest.raises(UserError, match="not both"):
        hub("org/repo:Layer", revision="main", version=1)


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, match",
    [
        (3, "key 3: not a module class"),
        (NotAModule, "not a module class"),
        ("not a/key", "not a module class"),
    ],
)
def test_a_bad_key_names_the_accepted_forms(llama, key, match):
    with pytest.raises(UserError, match=match) as info:
        kernelize(llama, {key: doubled})
    assert "the module class itself, or its dotted path" in str(info.value)


@pytest.mark.parametrize(
    "value, match",
    [
        (3, "'LlamaRMSNorm': int 3 is not a kernel; a value is a KernelChoice"),
        (None, "NoneType None is not a kernel"),
        (NotAModule, "is not an nn.Module subclass"),
        (NoForward, "defines no forward"),
        ("rms_norm", r"not a hub reference .*use KernelChoice\('rms_norm'\)"),
        ("kernels-community/activation", "not a hub reference 'owner/repo:LayerName'"),
        (lambda: None, "takes no positional argument"),
        (torch.nn.Identity(), "an instance of torch.nn.modules.linear.Identity; give the class"),
        ({"cpu": {"cpu": doubled}}, r"'LlamaRMSNorm'\['cpu'\]: dict"),
        ({0: doubled}, "device key 0 is not a device type"),
    ],
)
def test_a_bad_value_names_the_key_and_the_accepted_forms(llama, value, match):
    with pytest.raises(UserError, match=match):
        kernelize(llama, {"LlamaRMSNorm": value})
    assert _untouched(llama)


def test_errors_come_before_any_patch(llama):
    with pytest.raises(UserError, match="'LlamaRMSNorm'"):
        kernelize(llama, {LlamaMLP: KernelChoice("swiglu_mlp", ("torch",)), "LlamaRMSNorm": 3})
    with pytest.raises(UserError, match="super"):  # found while planning, before patching the MLPs
        kernelize(llama, {LlamaMLP: KernelChoice("swiglu_mlp", ("torch",)), LlamaRMSNorm: CallsSuper})
    assert _untouched(llama)


def test_a_class_value_that_needs_more_than_its_forward_is_refused(llama):
    with pytest.raises(UserError, match="forward uses super"):
        kernelize(llama, {LlamaRMSNorm: CallsSuper})
    with pytest.raises(UserError, match="defines scale, which LlamaRMSNorm instances lack"):
        kernelize(llama, {LlamaRMSNorm: NeedsHelper})
    assert _untouched(llama)


def test_a_dotted_key_is_matched_strictly(llama):
    with pytest.raises(UserError) as info:
        kernelize(llama, {"my_models.llama.LlamaRMSNorm": doubled})
    assert f"whose LlamaRMSNorm is {NORM_PATH}" in str(info.value)
    with pytest.raises(UserError, match="names a function or an attribute"):
        kernelize(llama, {"transformers.models.llama.modeling_llama.apply_rotary_pos_emb": doubled})
    with pytest.raises(UserError, match="names a function or an attribute"):
        kernelize(llama, {f"{NORM_PATH}.forward": doubled})
    kernelize(llama, {"transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": doubled})  # not in it
    assert _untouched(llama)


def test_a_mapping_must_be_a_dict(llama):
    with pytest.raises(UserError, match="expected a dict"):
        kernelize(llama, [("LlamaRMSNorm", doubled)])


# ---- the guarantees, with user values ------------------------------------------------------------


@pytest.mark.parametrize("value", [SameNorm, doubled], ids=["class", "function"])
def test_a_second_call_changes_nothing(twinkle_log, llama, value):
    kernelize(llama, {LlamaRMSNorm: value})
    forwards = {id(m): m.__dict__["forward"] for m in _norms(llama)}
    before = _logits(llama)
    twinkle_log.clear()

    assert kernelize(llama, {LlamaRMSNorm: value}) is llama
    assert {id(m): m.__dict__["forward"] for m in _norms(llama)} == forwards
    torch.testing.assert_close(_logits(llama), before, atol=0, rtol=0)
    assert _info(twinkle_log) == [
        f"kernelize: all {N_NORMS} mapped modules were already patched; model unchanged"
    ]


def test_another_model_of_the_class_is_unaffected(llama):
    other = _tiny_llama(seed=1)
    reference = _logits(other)
    kernelize(llama, {LlamaRMSNorm: doubled, "LlamaMLP": KernelChoice("swiglu_mlp", ("torch",))})
    assert _untouched(other)
    torch.testing.assert_close(_logits(other), reference, atol=0, rtol=0)
    llama_module = importlib.import_module("transformers.models.llama.modeling_llama")
    assert llama_module.LlamaRMSNorm.forward.__qualname__ == "LlamaRMSNorm.forward"


@pytest.mark.parametrize("value", [SameNorm, doubled], ids=["class", "function"])
def test_a_deep_copy_reads_its_own_weights(llama, value):
    kernelize(llama, {LlamaRMSNorm: value})
    clone = copy.deepcopy(llama)
    for norm in _norms(clone):
        assert norm.forward.__self__ is norm and getattr(norm, MARK)[0] == "custom"
    before = _logits(llama)
    with torch.no_grad():
        clone.model.norm.weight.mul_(2.0)
    assert not torch.allclose(_logits(clone), before)
    torch.testing.assert_close(_logits(llama), before, atol=0, rtol=0)
